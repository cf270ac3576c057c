#!/usr/bin/env python3
"""Make the figures tables of README.md and docs/PERFORMANCE.md from the
JSON of one `cuda-ipc bench` run (`--json-out`).

    cuda-ipc bench --json-out bench.json          # on a GPU host (a full run: no --quick)
    python3 scripts/bench_tables.py bench.json --commit "$(git rev-parse --short HEAD)" --write

Each table goes between its two marker lines (``<!-- bench-table:NAME:begin -->``
and ``...:end -->``) and is never edited by hand: the caption names the
machine, the date and the commit once, and every figure below it is that
run's. Without ``--write`` the tables are printed. Standard library only.

Exit status 0 on success; 2 for a bad argument, a file that is not a bench
report, or a report without a row a table needs (named in the message).
"""

import argparse
import datetime
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB, GiB = 1 << 20, 1 << 30
PY = "ours from Python"

def row(section, series, variant=None, size=None, count=None, figure="p50"):
    """A lookup: the first measured row of ``section`` (without MPS) with this
    series, variant, size (bytes) and count (None: any), and its median or,
    with ``figure="value"``, its single figure (a ring's frames/s)."""
    return {"section": section, "series": series, "variant": variant, "size": size, "count": count,
            "figure": figure}


def fps(series, variant=None):
    return row("sync", series, variant, 4096, figure="value")


# The rows of PERFORMANCE.md's table: (a headline row, README.md's table too;
# what is handed off; ours; the alternative's name and lookup, or None).
ROWS = [
    (True, "a new 64 MiB buffer from an arena (vmm)", row("arena", "vmm", size=64 * MiB),
     ("PyTorch, torch.multiprocessing", row("torch", "PyTorch", "fresh", 64 * MiB))),
    (False, "a new 2 MiB buffer from an arena (vmm)", row("arena", "vmm", size=2 * MiB),
     ("PyTorch, torch.multiprocessing", row("torch", "PyTorch", "fresh", 2 * MiB))),
    (False, "a new 1 GiB buffer from an arena (vmm)", row("arena", "vmm", size=GiB),
     ("PyTorch, torch.multiprocessing", row("torch", "PyTorch", "fresh", GiB))),
    (False, "a new 64 MiB buffer exported on its own (legacy)", row("fresh", "legacy", size=64 * MiB),
     ("the driver's own calls", row("floor", "legacy floor", size=64 * MiB))),
    (False, "a new 64 MiB buffer exported on its own (vmm)", row("fresh", "vmm", size=64 * MiB),
     ("the driver's own calls", row("floor", "vmm floor", size=64 * MiB))),
    (True, "new contents of a mapped 64 MiB buffer (vmm)", row("cached", "vmm", size=64 * MiB),
     ("PyTorch, the same tensor sent again", row("torch", "PyTorch", "repeat", 64 * MiB))),
    (False, "new contents of a mapped 8 GiB buffer (vmm)", row("cached", "vmm", size=8 * GiB),
     ("PyTorch, the same tensor sent again", row("torch", "PyTorch", "repeat", 8 * GiB))),
    (False, "100 fp32 tensors (4 GiB) as one set, from Rust", row("sets", "ours", "set", count=100),
     ("PyTorch, a list of tensors", row("sets", "PyTorch", "list", count=100))),
    (True, "1,000 fp32 tensors (4 GiB) as one set, from Rust", row("sets", "ours", "set", count=1000),
     ("PyTorch, a list of tensors", row("sets", "PyTorch", "list", count=1000))),
    (False, "1,000 fp32 tensors (4 GiB) as one set, from Rust", row("sets", "ours", "set", count=1000),
     ("PyTorch, one flattened bucket (+4 GiB)", row("sets", "PyTorch", "bucket", count=1000))),
    (True, "1,000 fp32 tensors (4 GiB) as one state dict, from Python", row("sets", PY, "set", count=1000),
     ("PyTorch, a list of tensors", row("sets", "PyTorch", "list", count=1000))),
    (False, "10,000 fp32 tensors (4 GiB) as one set, from Rust", row("sets", "ours", "set", count=10000),
     ("PyTorch, a list of tensors", row("sets", "PyTorch", "list", count=10000))),
    (False, "10,000 fp32 tensors (4 GiB) as one state dict, from Python", row("sets", PY, "set", count=10000),
     ("PyTorch, a list of tensors", row("sets", "PyTorch", "list", count=10000))),
    (True, "an update of a held 1,000-tensor set, from Rust", row("sets", "ours", "update", count=1000), None),
    (False, "an update of a held 1,000-tensor state dict, from Python", row("sets", PY, "update", count=1000),
     None),
    (True, "a new Python process attaching a 4.37 GB model", row("sets", PY, "first attach"),
     ("safetensors load_file, page cache", row("sets", "safetensors", "load_file"))),
    (True, "copy out of a 1 GiB mapping (vmm)", row("bandwidth", "vmm", "from_mapping", GiB),
     ("a copy between local buffers", row("bandwidth", "vmm", "local", GiB))),
    (False, "4 KiB frames through a ring, fences", fps("fence", "load"),
     ("the producer alone, no consumer", fps("floor: fill + signal"))),
    (False, "4 KiB frames through a ring, host-waited fences", fps("host-fence", "load"),
     ("the producer alone, no consumer", fps("floor: fill + signal"))),
    (False, "a notice to a process asleep for 1 ms (no GPU)", row("floor", "wake", "asleep, 1 ms idle"),
     ("the same process spinning", row("floor", "wake", "spinning, 1 ms idle"))),
]


class Missing(Exception):
    pass


def _matches(r, want):
    for key in ("series", "variant", "size", "count"):
        if want[key] is not None and r.get(key) != want[key]:
            return False
    if want["variant"] is None and r.get("variant") is not None:
        return False
    return r.get("error") is None and r.get("skipped") is None


def find(report, want):
    """The figure ``want`` names and its unit; Missing when the report has
    no such measured row."""
    for s in report.get("sections", []):
        if s.get("mps") or s.get("id") != want["section"]:
            continue
        for r in s.get("rows", []):
            if not _matches(r, want):
                continue
            if want["figure"] == "value" and r.get("value") is not None:
                return r["value"], "frames/s"
            if want["figure"] == "p50" and (r.get("stats") or {}).get("p50") is not None:
                return r["stats"]["p50"], r.get("unit", "ms")
    described = ", ".join(f"{k} {v!r}" for k, v in want.items() if v is not None and k != "figure")
    raise Missing(f"the report has no measured row with {described}")


def shown(value, unit):
    """A figure as the tables print it: about three significant digits."""
    if unit in ("frames/s", "GB/s"):
        return f"{value:,.0f} {unit}"
    if value >= 100:
        text = f"{value:,.0f}"
    elif value >= 10:
        text = f"{value:.1f}"
    elif value >= 1:
        text = f"{value:.2f}"
    elif value >= 0.01:
        text = f"{value:.3f}"
    else:
        text = f"{value:.4f}"
    return f"{text} {unit}"


def ratio(ours, theirs, unit):
    """How many times better ours is (lower time, higher rate)."""
    if ours <= 0 or theirs <= 0:
        return "-"
    x = ours / theirs if unit in ("frames/s", "GB/s") else theirs / ours
    return f"{x:,.2f}x" if x < 10 else f"{x:,.0f}x"


def caption(report, commit, source):
    device = (report.get("device") or {}).get("name") or "an unnamed GPU"
    driver = (report.get("device") or {}).get("driver")
    started = report.get("started_unix_s")
    if not started:
        raise Missing("the report has no start time (started_unix_s)")
    date = datetime.datetime.fromtimestamp(started, datetime.timezone.utc).strftime("%Y-%m-%d")
    run = "quick run" if report.get("quick") else "full run"
    where = f"{device}" + (f", driver CUDA {driver}" if driver else "")
    return (f"Measured on an {where}, {date}, commit {commit} (`cuda-ipc bench`, {run}; {source}). "
            f"Median (p50) of each row's samples, one way, across two processes; "
            f"x: how many times faster cuda-ipc is (below 1: slower).")


def table(report, headline, commit, source):
    lines = [f"*{caption(report, commit, source)}*", "",
             "| hand-off | cuda-ipc | compared with | that | x |", "|---|---|---|---|---|"]
    for is_headline, what, ours_at, alternative in ROWS:
        if headline and not is_headline:
            continue
        ours, unit = find(report, ours_at)
        if alternative is None:
            lines.append(f"| {what} | {shown(ours, unit)} | - | - | - |")
            continue
        name, theirs_at = alternative
        theirs, their_unit = find(report, theirs_at)
        lines.append(f"| {what} | {shown(ours, unit)} | {name} | {shown(theirs, their_unit)} | "
                     f"{ratio(ours, theirs, unit)} |")
    return "\n".join(lines)


TARGETS = {"README.md": ("headline", True), os.path.join("docs", "PERFORMANCE.md"): ("full", False)}


def replace_between(text, name, body, path):
    begin, end = f"<!-- bench-table:{name}:begin -->", f"<!-- bench-table:{name}:end -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise Missing(f"{path} has no {begin} ... {end} lines to write the table between")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text, count=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="the JSON a `cuda-ipc bench --json-out FILE` run wrote")
    ap.add_argument("--commit", required=True, help="the commit the bench was built from (git rev-parse --short HEAD)")
    ap.add_argument("--source", default="made from its `--json-out` report by scripts/bench_tables.py",
                    help="how the figures were taken, for the caption")
    ap.add_argument("--write", action="store_true", help="write the tables into README.md and docs/PERFORMANCE.md")
    ap.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[0-9a-f]{7,40}", args.commit):
        ap.error(f"--commit {args.commit!r} is not a commit hash (7 to 40 hex digits)")
    try:
        with open(args.report) as f:
            report = json.load(f)
        if not isinstance(report, dict) or report.get("schema") != 1 or "sections" not in report:
            raise Missing(f"{args.report} is not the JSON of a `cuda-ipc bench` run (schema 1)")
        tables = {path: table(report, headline, args.commit, args.source)
                  for path, (_, headline) in TARGETS.items()}
        if not args.write:
            for path, body in tables.items():
                print(f"{path}:\n{body}\n")
            return 0
        for path, body in tables.items():
            full = os.path.join(args.root, path)
            with open(full) as f:
                text = f.read()
            text = replace_between(text, TARGETS[path][0], body, path)
            with open(full, "w") as f:
                f.write(text)
            print(f"bench_tables: wrote the table of {path}")
    except (OSError, ValueError, Missing) as e:
        print(f"bench_tables: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
