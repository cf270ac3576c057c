#!/usr/bin/env python3
"""Checks that no tracked file is longer than a reader can hold: at most
700 lines, except Cargo.lock and test data (generated or recorded, not
read). Prints the longest files, then every offender; exit 1 when there is
one. Standard library and git only.

    python3 scripts/check_lines.py             # the check
    python3 scripts/check_lines.py --top N     # also list the N longest files (default 5)

A file that outgrows the limit is split along its seams (a module per
concern, a test file per area, a reference document beside a guide), not
cut in two.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 700
# Paths exempt from the limit: generated files and test data, not read by people.
EXEMPT_FILES = {"Cargo.lock"}
EXEMPT_DIRS = ("crates/cuda-ipc/tests/data/", "scripts/testdata/", "fuzz/corpus/")


def tracked():
    """The files git tracks, relative to the repository root."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


def exempt(path):
    return path in EXEMPT_FILES or path.startswith(EXEMPT_DIRS)


def count_lines(path):
    """Lines of ``path`` (a last line without a newline counts); None for a missing file."""
    try:
        with open(os.path.join(ROOT, path), "rb") as f:
            data = f.read()
    except (FileNotFoundError, IsADirectoryError):
        return None  # deleted in the work tree, or a submodule
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def main(argv):
    top = 5
    if argv[:1] == ["--top"] and len(argv) == 2 and argv[1].isdigit():
        top = int(argv[1])
    elif argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    counted = []
    for path in tracked():
        if exempt(path):
            continue
        n = count_lines(path)
        if n is not None:
            counted.append((n, path))
    counted.sort(reverse=True)
    for n, path in counted[:top]:
        print(f"check_lines: {n:6} {path}")
    offenders = [(n, p) for n, p in counted if n > MAX_LINES]
    for n, path in offenders:
        print(f"check_lines: {path} has {n} lines; at most {MAX_LINES}", file=sys.stderr)
    if not offenders:
        print(f"check_lines: no tracked file over {MAX_LINES} lines (Cargo.lock and test data exempt)")
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
