#!/usr/bin/env python3
"""Counts each library crate's public surface, from rustdoc's JSON output.

    python3 scripts/public_items.py [--max-core N] [CRATE ...]

For each crate (default: the library crates), prints the public items a
user can name (modules, types, traits, functions, methods of inherent
impls and traits, constants, statics, type aliases, macros; a re-export
is the item it names, counted once) and public struct fields, first as documented, then with the items marked
`#[doc(hidden)]` (what the crates above use of the one below, not for
users). Items re-exported from another crate count in the crate that
defines them. Needs a nightly toolchain (`rustup toolchain install
nightly`): rustdoc's JSON output is unstable. With --max-core N, exits 1
when cuda-ipc-core has N or more public items, hidden ones included.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip()
LIBRARY = ["cuda-ipc-core", "cuda-ipc-exchange", "cuda-ipc-service", "cuda-ipc-channel", "cuda-ipc-shm", "cuda-ipc"]


def rustdoc_json(crate, hidden):
    """Runs rustdoc for `crate` and returns its JSON document."""
    out = os.path.join(ROOT, "target", "public-items", "hidden" if hidden else "shown")
    flags = ["-Z", "unstable-options", "--output-format", "json"]
    if hidden:
        flags.append("--document-hidden-items")
    subprocess.run(
        ["cargo", "+nightly", "rustdoc", "-q", "--lib", "-p", crate, "--target-dir", out, "--"] + flags,
        cwd=ROOT,
        check=True,
    )
    with open(os.path.join(out, "doc", crate.replace("-", "_") + ".json")) as f:
        return json.load(f)


def count(doc):
    """(items, fields) of the crate's own public surface, walked from its root."""
    index = doc["index"]
    seen = set()
    items = fields = 0

    def kind(item):
        return next(iter(item["inner"]))

    def walk(item_id):
        nonlocal items, fields
        key = str(item_id)
        if key in seen or key not in index:
            return
        seen.add(key)
        item = index[key]
        if item["crate_id"] != 0:
            return
        k = kind(item)
        inner = item["inner"][k]
        if k == "struct_field":
            fields += 1
            return
        if k in ("impl",):
            # Inherent impls only: a trait's methods count once, on the trait.
            if inner["trait"] is None and not inner.get("is_synthetic") and inner.get("blanket_impl") is None:
                for i in inner["items"]:
                    walk(i)
            return
        if k == "variant":
            return
        if k != "use":
            items += 1
        if k == "module":
            for i in inner["items"]:
                walk(i)
        elif k == "struct":
            kind_ = inner["kind"]
            if isinstance(kind_, dict) and "plain" in kind_:
                for f in kind_["plain"]["fields"]:
                    walk(f)
            elif isinstance(kind_, dict) and "tuple" in kind_:
                for f in kind_["tuple"]:
                    if f is not None:
                        walk(f)
            for i in inner["impls"]:
                walk(i)
        elif k == "enum":
            for i in inner["impls"]:
                walk(i)
        elif k == "trait":
            for i in inner["items"]:
                walk(i)
        elif k == "use":
            if inner.get("id") is not None:
                walk(inner["id"])

    walk(doc["root"])
    return items, fields


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("crates", nargs="*", default=LIBRARY)
    ap.add_argument("--max-core", type=int)
    args = ap.parse_args()
    print(f"{'crate':<20} {'items':>6} {'fields':>7} {'items with hidden':>18} {'fields with hidden':>19}")
    core_total = None
    for crate in args.crates:
        shown = count(rustdoc_json(crate, False))
        total = count(rustdoc_json(crate, True))
        print(f"{crate:<20} {shown[0]:>6} {shown[1]:>7} {total[0]:>18} {total[1]:>19}")
        if crate == "cuda-ipc-core":
            core_total = total[0]
    if args.max_core is not None and core_total is not None and core_total >= args.max_core:
        print(f"cuda-ipc-core has {core_total} public items, hidden ones included: not under {args.max_core}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
