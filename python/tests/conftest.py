# pytest configuration for the Python module's tests (python/tests/test_kvevict.py).
#
#   PYTHONPATH=build/<preset>/python KVEVICT_SELECT=build/<preset>/tools/kvevict-select \
#       /usr/bin/python3 -m pytest python/tests -q
#
# The module is imported from PYTHONPATH; without one that provides it, the first build/<preset>/python that holds
# a built module is used (so that `pytest python/tests` works from a build tree too). The kvevict-select comparisons
# read the tool's path from KVEVICT_SELECT and are skipped when it is unset.

import glob
import importlib
import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_kvevict():
    try:
        importlib.import_module("kvevict")
        return
    except ImportError:
        pass
    for folder in sorted(glob.glob(os.path.join(_ROOT, "build", "*", "python"))):
        if glob.glob(os.path.join(folder, "kvevict*.so")) or glob.glob(os.path.join(folder, "kvevict*.pyd")):
            sys.path.insert(0, folder)
            try:
                importlib.import_module("kvevict")
                return
            except ImportError:
                sys.path.remove(folder)


_import_kvevict()


@pytest.fixture(scope="session")
def kvevict_select():
    """The path of kvevict-select (environment variable KVEVICT_SELECT); skips the test when it is unset."""
    path = os.environ.get("KVEVICT_SELECT")
    if not path:
        pytest.skip("KVEVICT_SELECT is not set: set it to the kvevict-select executable to compare with the tool")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail("KVEVICT_SELECT=%r is not an executable file" % path)
    return path
