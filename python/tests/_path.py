"""Lets the tests import the package: an installed build (a wheel, `pip
install ./python`) if there is one, else this checkout's python/ folder
(after `maturin develop`, which puts the extension module there)."""

import os
import sys

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(PYTHON_DIR)
try:
    import cuda_ipc._core  # noqa: F401
except ImportError:
    if PYTHON_DIR not in sys.path:
        sys.path.insert(0, PYTHON_DIR)
    sys.modules.pop("cuda_ipc", None)

CASES = os.path.join(REPO, "crates", "cuda-ipc", "tests", "data", "torch", "cases.json")

import cuda_ipc  # noqa: E402

# The folder holding the package the tests use, for child interpreters.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(cuda_ipc.__file__)))
