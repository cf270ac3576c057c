#!/usr/bin/env python3
"""Checks that the documents stay what a user reads in five minutes, and
prints the command blocks CI runs exactly as the documents give them.

    python3 scripts/check_docs.py                      # the checks (exit 1 with what is wrong)
    python3 scripts/check_docs.py block FILE NAME      # the block after <!-- ci: NAME --> in FILE

The checks: README.md has at most 200 lines; every `<!-- example: PATH -->`
block of README.md is the file PATH, less its lines that check the
example's needs (`_needs`); no file under docs/ holds a commit hash outside
a caption (a line in italics, `*...*`) or a code block; docs/*.md together
hold at most 3,000 lines; every `<!-- ci: NAME -->` block is the same in
every document that has one of that name. Standard library only.
"""

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 200
DOCS_MAX_LINES = 3000
# A commit hash: 7 to 40 hex digits with at least one digit and one letter.
HASH = re.compile(r"(?<![\w-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def blocks(text, marker):
    """(name, body) of every fenced block right after a `<!-- MARKER: NAME -->` line."""
    found = []
    for m in re.finditer(rf"^<!-- {marker}: (\S+) -->\n```[a-z]*\n(.*?)^```", text, re.M | re.S):
        found.append((m.group(1), m.group(2)))
    return found


def outside_code(text):
    """The lines of ``text`` outside fenced code blocks, with their numbers."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def check():
    problems = []
    readme = read("README.md")
    lines = readme.count("\n")
    if lines > README_MAX_LINES:
        problems.append(f"README.md has {lines} lines; at most {README_MAX_LINES}")
    for path, body in blocks(readme, "example"):
        want = "".join(line for line in read(path).splitlines(keepends=True) if "_needs" not in line)
        if body != want:
            problems.append(f"README.md's block of {path} is not that file (less its `_needs` lines)")
    total = 0
    ci_blocks = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md"),
                                                                       os.path.join(ROOT, "python", "README.md")]:
        rel = os.path.relpath(path, ROOT)
        text = read(rel)
        for name, body in blocks(text, "ci"):
            ci_blocks.setdefault(name, {})[rel] = body
        if not rel.startswith("docs" + os.sep):
            continue
        total += text.count("\n")
        for number, line in outside_code(text):
            caption = line.startswith("*") and line.rstrip().endswith("*")
            for m in HASH.finditer(line):
                if not caption:
                    problems.append(f"{rel}:{number}: {m.group(0)} looks like a commit hash outside a caption")
    if total > DOCS_MAX_LINES:
        problems.append(f"docs/*.md hold {total} lines; at most {DOCS_MAX_LINES}")
    for name, where in ci_blocks.items():
        if len(set(where.values())) > 1:
            problems.append(f"the `ci: {name}` blocks differ between {', '.join(sorted(where))}")
    for p in problems:
        print(f"check_docs: {p}", file=sys.stderr)
    if not problems:
        print(f"check_docs: README.md {lines} lines, docs/*.md {total} lines, no commit hash outside a caption")
    return 1 if problems else 0


def main(argv):
    if argv[:1] == ["block"] and len(argv) == 3:
        found = dict(blocks(read(argv[1]), "ci"))
        if argv[2] not in found:
            print(f"check_docs: {argv[1]} has no <!-- ci: {argv[2]} --> block", file=sys.stderr)
            return 2
        sys.stdout.write(found[argv[2]])
        return 0
    if argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return check()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
