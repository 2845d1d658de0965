#!/usr/bin/env python3
"""Every citation of docs/algorithms.md must name an anchor that exists.

docs/algorithms.md gives each section an HTML anchor (`<a id="forcing"></a>` above its heading); code, tests and the
other documents cite a section as `docs/algorithms.md#forcing` (markdown: `[Forcing](algorithms.md#forcing)`, and
`[Forcing](#forcing)` inside docs/algorithms.md itself). This check fails (exit 1, one `file:line: ...` line per
problem) when
  - a tracked file cites `algorithms.md#<name>`, or docs/algorithms.md links `](#<name>)`, and <name> is not one of
    its anchors;
  - a tracked file still cites docs/algorithms.md by a section number ("algorithms.md" then "section 2.6", "sections
    6 and 7", "§2.6" or a bare "2.6", also across a line break): the sections are no longer numbered.
docs/results/ is skipped: those are historical records and stay as they were written.

Usage: anchors.py [REPO_ROOT]   (default: the repository holding this script, two folders up)
"""
import os
import re
import subprocess
import sys

DOC = "docs/algorithms.md"
SKIP_PREFIXES = ("docs/results/",)
ANCHOR_DEF = re.compile(r'<a\s+id="([^"]+)"\s*>\s*</a>')
CITE = re.compile(r"algorithms\.md#([A-Za-z0-9_-]+)")
LOCAL_LINK = re.compile(r"\]\(#([A-Za-z0-9_-]+)\)")
NUMBERED = re.compile(r"algorithms\.md[),]*\s+\(?(?:sections?\s+|§\s*)?[0-9]|algorithms\.md[),]*\s*§")
# "... docs/algorithms.md" at the end of a line, "section 7 ..." at the start of the next (after a comment marker).
LINE_END = re.compile(r"algorithms\.md[),(]*\s*$")
NEXT_START = re.compile(r"^\s*(?:///?<?|#|\*|--)?\s*\(?(?:sections?\s+[0-9]|§)")


def tracked_files(root):
    """`git ls-files`, or, outside a git checkout (a source archive), every file but hidden and build folders."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], check=True, capture_output=True).stdout
        files = out.decode("utf-8").split("\0")
    except (OSError, subprocess.CalledProcessError):
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".")
                       and not os.path.exists(os.path.join(folder, d, "CMakeCache.txt"))]
            files += [os.path.relpath(os.path.join(folder, n), root).replace(os.sep, "/") for n in names]
    return [f for f in files if f and not f.startswith(SKIP_PREFIXES)]


def read_text(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:  # listed by git but absent from the work tree (deleted, not yet committed)
        return None
    if b"\0" in data:
        return None  # binary
    return data.decode("utf-8", errors="replace")


def main(argv):
    root = os.path.abspath(argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
    doc = read_text(os.path.join(root, DOC))
    if doc is None:
        print(f"anchors.py: {DOC} not found under {root}")
        return 1
    anchors = set(ANCHOR_DEF.findall(doc))
    if not anchors:
        print(f"anchors.py: no <a id=...> anchors in {DOC}")
        return 1

    problems = []
    files = tracked_files(root)
    cites = 0
    for rel in files:
        text = read_text(os.path.join(root, rel))
        if text is None:
            continue
        lines = text.splitlines()
        for n, line in enumerate(lines, 1):
            names = CITE.findall(line)
            if rel == DOC:
                names += LOCAL_LINK.findall(line)
            for name in names:
                cites += 1
                if name not in anchors:
                    problems.append(f"{rel}:{n}: cites missing anchor '#{name}' of {DOC}")
            if NUMBERED.search(line) or (LINE_END.search(line) and n < len(lines) and NEXT_START.match(lines[n])):
                problems.append(f"{rel}:{n}: cites {DOC} by a section number; cite its anchor instead")

    for p in problems:
        print(p)
    if problems:
        print(f"anchors.py: {len(problems)} problem(s); anchors of {DOC}: {', '.join(sorted(anchors))}")
        return 1
    print(f"anchors.py: OK, {cites} citations in {len(files)} tracked files, all among the {len(anchors)} anchors "
          f"of {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
