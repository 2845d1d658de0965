#!/usr/bin/env python3
"""Pins the names each public header makes reachable (tests/headers/api_names.txt).

clang's -ast-list prints the qualified name of every declaration a translation unit sees. Of those, this keeps the
namespace-scope names of kvevict:: (and kvevict::catalogue::) that <kvevict/kvevict.hpp> declares, the engine API, and
those of kvevict::extend:: that <kvevict/extend.hpp> declares, the extension API; kvevict::detail:: is neither and is
not listed. The test fails when a header adds a name the list does not have (a leak: move it into detail::, or add it
to the list on purpose and document it) or loses one the list has (an engine's code stops compiling), and when
extend.hpp adds a name to kvevict:: that kvevict.hpp does not have (extension headers add to extend:: only).

  api_names.py --clang clang++ --include include --eigen /usr/include/eigen3 --list tests/headers/api_names.txt
  (add --write to rewrite the list from the headers)
"""

import argparse
import re
import subprocess
import sys
import tempfile

# Namespaces (the inline ABI namespaces serial/openmp are omitted from qualified names by clang, but listed alone).
NAMESPACES = {"detail", "extend", "catalogue", "serial", "openmp"}


def reachable(clang, include, eigen, header):
    with tempfile.NamedTemporaryFile("w", suffix=".cpp") as tu:
        tu.write("#include <%s>\n" % header)
        tu.flush()
        out = subprocess.run([clang, "-std=c++17", "-fsyntax-only", "-I", include, "-isystem", eigen, "-Xclang",
                              "-ast-list", tu.name], capture_output=True, text=True, check=True).stdout
    names = set()
    for line in out.splitlines():
        m = re.fullmatch(r"kvevict::(?:(catalogue|extend)::)?([A-Za-z_][A-Za-z_0-9]*)", line.strip())
        if not m or m.group(2) in NAMESPACES or re.fullmatch(r"[A-Z]", m.group(2)):
            continue  # not a namespace-scope name, a namespace, or a template parameter (clang lists T, S)
        names.add((m.group(1) + "::" if m.group(1) else "") + m.group(2))
    return names


def read_list(path):
    sections, current = {}, None
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if re.fullmatch(r"\[\w+\]", line):
            current = sections.setdefault(line[1:-1], set())
        elif line:
            current.update(line.split())
    return sections


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clang", required=True)
    ap.add_argument("--include", required=True)
    ap.add_argument("--eigen", required=True)
    ap.add_argument("--list", required=True)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()

    engine_all = reachable(a.clang, a.include, a.eigen, "kvevict/kvevict.hpp")
    extend_all = reachable(a.clang, a.include, a.eigen, "kvevict/extend.hpp")
    engine = {n for n in engine_all if not n.startswith("extend::")}
    extend = {n for n in extend_all if n.startswith("extend::")}
    failures = ["extend.hpp adds %s, which kvevict.hpp does not have: extension headers add to extend:: only" % n
                for n in sorted(extend_all - engine_all) if not n.startswith("extend::")]

    if a.write:
        with open(a.list, "w") as f:
            f.write("# The names <kvevict/kvevict.hpp> (engine) and <kvevict/extend.hpp> (extend) make reachable,\n"
                    "# pinned by tests/headers/api_names.py (kvevict::detail:: is not API and not listed).\n")
            for section, names in (("engine", engine), ("extend", extend)):
                f.write("[%s]\n" % section)
                for n in sorted(names, key=str.lower):
                    f.write(n + "\n")
        print("wrote %d engine and %d extension names to %s" % (len(engine), len(extend), a.list))
        return 0

    pinned = read_list(a.list)
    for section, names in (("engine", engine), ("extend", extend)):
        want = pinned.get(section, set())
        for n in sorted(names - want):
            failures.append("[%s] %s is reachable and not in %s: a leak (move it into detail::) or a new API name "
                            "(add it to the list)" % (section, n, a.list))
        for n in sorted(want - names):
            failures.append("[%s] %s is in %s and no longer reachable: engines using it stop compiling" %
                            (section, n, a.list))
    for f in failures:
        print("api_names: " + f)
    print("api_names: %d engine names, %d extension names, %d problems" % (len(engine), len(extend), len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
