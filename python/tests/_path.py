"""Lets the tests import the package from this checkout, installed or not."""

import os
import sys

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(PYTHON_DIR)
if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)

CASES = os.path.join(REPO, "crates", "cuda-ipc", "tests", "data", "torch", "cases.json")
