#!/usr/bin/env python3
"""Where the time of a Python `attach_state_dict` goes (issue 24): a
publisher (this process) publishes COUNT fp32 tensors of TOTAL bytes (the
bench's weight_set_sizes draw) made in its arena; a consumer process
attaches the set REPS times and times each part, then times PyTorch's own
ways of making as many tensors, in the same process, as the floor the
extension's per-tensor work is held against. JSON lines:

  {"kind": "hello", "torch": ..., "cuda_ipc": ..., "path": "C API" | "Python", "why": ...}
  {"kind": "parts", "count": N, "reps": R, "ms": {PART: [samples]}}
  {"kind": "floor", "count": N, "ms": {WAY: median}}
  {"kind": "profile", "top": [[function, calls, cumulative ms], ...]}
  {"kind": "publish", "count": N, "reps": R, "ms": {"publish": [...], "unpublish": [...]},
   "median": {...}}
  {"kind": "phases", "call": CALL, "count": N, "median_us": {PHASE: µs}}
  {"kind": "skip", "reason": ...} / {"kind": "error", "message": ...}

Parts (consumer, time.perf_counter_ns): `attach_set` (the Rust
Subscriber.attach_set: the request, the answer, the mappings, the event
waited), `tensors` (cuda_ipc.sets.attach_state_dict over that attachment:
every tensor and the dict), `release`; `total` their sum. Floors: COUNT
`torch.empty(0, device=cuda)`, COUNT `as_strided` views of one tensor, one
`split` into COUNT views, and COUNT `torch.from_dlpack` of one tensor's
capsule (PyTorch's own DLPack import). `profile`: cProfile of one attach's
Python side, the functions with the largest cumulative time. `phases`: the
extension's own clock of each phase of its bulk calls (`attach_set`,
`attach_state_dict`, `publish_state_dict`) and the library's under them
(`core.attach_set`, `core.publish_set`), read with `_core._last_phases`,
medians over the samples.

Publisher (time.perf_counter_ns, after the consumer is done): `publish`,
`Publisher.publish_state_dict` of the same COUNT tensors (in the arena
already: nothing is copied) under a new name each time, and `unpublish`
of it (no consumer holds it); PUBLISH_REPS samples after 2 thrown away.
`--publish-only` skips the consumer, so that a profiler (`perf record -g
-- python3 attach_parts.py --publish-only --publish-reps 500`) sees the
publish alone.

Usage: attach_parts.py [--count 1000] [--total 268435456] [--reps 20] [--device 0]
                       [--publish-reps 20] [--publish-only]
       (CUDA_IPC_TORCH_C_API=0 takes the Python path)
"""

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_share import emit, weight_set_sizes  # noqa: E402

SET = "parts"


def ms(t0, t1):
    return (t1 - t0) / 1e6


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2] if s else None


def keep_phases(into, call):
    """Adds the last run's phases of the extension's ``call`` to ``into``."""
    from cuda_ipc import _core

    for phase, us in _core._last_phases(call):
        into.setdefault(phase, []).append(us)


def emit_phases(call, count, phases):
    emit({"kind": "phases", "call": call, "count": count,
          "median_us": {k: round(median(v), 1) for k, v in phases.items()}})


def floors(torch, count):
    """PyTorch's own ways of making ``count`` tensors, median ms of 5."""
    base = torch.empty(count * 64, device="cuda")
    ways = {
        "torch.empty(0)": lambda: [torch.empty(0, device="cuda") for _ in range(count)],
        "as_strided": lambda: [base.as_strided((64,), (1,), i * 64) for i in range(count)],
        "split": lambda: base.split(64),
        "from_dlpack": lambda: [torch.from_dlpack(base) for _ in range(count)],
    }
    out = {}
    for name, make in ways.items():
        samples = []
        for _ in range(6):
            t0 = time.perf_counter_ns()
            made = make()
            samples.append(ms(t0, time.perf_counter_ns()))
            del made
        out[name] = median(samples[1:])
    return out


def consumer(path, device, reps, count):
    import cuda_ipc
    import torch
    from cuda_ipc import _torch_c
    from cuda_ipc import sets as _sets

    torch.cuda.set_device(device)
    torch.cuda.init()
    sub = cuda_ipc.Subscriber(path, device=device, timeout=30)
    st = _torch_c.status() if hasattr(_torch_c, "status") else None
    emit({"kind": "hello", "torch": torch.__version__, "cuda_ipc": cuda_ipc.__version__,
          "path": "C API" if _torch_c.exchange() is not None else "Python", "why": st})
    parts = {"attach_set": [], "tensors": [], "release": [], "total": []}
    phases = {"attach_set": {}, "core.attach_set": {}, "attach_state_dict": {}}
    for i in range(reps + 2):
        t0 = time.perf_counter_ns()
        core = sub._c.attach_set(SET)
        t1 = time.perf_counter_ns()
        sd = _sets.attach_state_dict(core)
        t2 = time.perf_counter_ns()
        if len(sd) != count:
            raise RuntimeError("attached %d tensors, published %d" % (len(sd), count))
        sd.release()
        del sd, core
        t3 = time.perf_counter_ns()
        if i >= 2:
            for call, into in phases.items():
                keep_phases(into, call)
            for k, v in (("attach_set", ms(t0, t1)), ("tensors", ms(t1, t2)),
                         ("release", ms(t2, t3)), ("total", ms(t0, t3))):
                parts[k].append(round(v, 4))
    emit({"kind": "parts", "count": count, "reps": reps, "ms": parts,
          "median": {k: median(v) for k, v in parts.items()}})
    for call, into in phases.items():
        emit_phases(call, count, into)
    prof = cProfile.Profile()
    core = sub._c.attach_set(SET)
    prof.enable()
    sd = _sets.attach_state_dict(core)
    prof.disable()
    sd.release()
    del sd, core
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:15]
    emit({"kind": "profile", "top": [["%s:%d(%s)" % (f[0].split("/")[-1], f[1], f[2]), v[1], round(v[3] * 1e3, 3)]
                                     for f, v in rows]})
    emit({"kind": "floor", "count": count, "ms": floors(torch, count)})
    sub.close()


def publish_parts(pub, tensors, reps):
    """Times ``reps`` publishes and unpublishes of ``tensors`` (2 more
    thrown away first); emits the publish line."""
    parts = {"publish": [], "unpublish": []}
    phases = {"publish_state_dict": {}, "core.publish_set": {}}
    for i in range(reps + 2):
        name = "%s-again-%d" % (SET, i)
        t0 = time.perf_counter_ns()
        pub.publish_state_dict(name, tensors)
        t1 = time.perf_counter_ns()
        pub.unpublish(name, timeout=30)
        t2 = time.perf_counter_ns()
        if i >= 2:
            for call, into in phases.items():
                keep_phases(into, call)
            parts["publish"].append(round(ms(t0, t1), 4))
            parts["unpublish"].append(round(ms(t1, t2), 4))
    emit({"kind": "publish", "count": len(tensors), "reps": reps, "ms": parts,
          "median": {k: median(v) for k, v in parts.items()}})
    for call, into in phases.items():
        emit_phases(call, len(tensors), into)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--total", type=int, default=256 << 20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--publish-reps", type=int, default=20)
    ap.add_argument("--publish-only", action="store_true", help="time the publisher only (for a profiler)")
    ap.add_argument("--consumer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        import cuda_ipc
        import torch
    except ImportError as e:
        emit({"kind": "skip", "reason": "%s is not importable" % e.name})
        return 0
    if args.consumer:
        consumer(args.consumer, args.device, args.reps, args.count)
        return 0
    if not torch.cuda.is_available():
        emit({"kind": "skip", "reason": "PyTorch sees no CUDA device"})
        return 0
    torch.cuda.set_device(args.device)
    path = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-parts-"), "p.sock")
    pub = cuda_ipc.Publisher(path, device=args.device)
    try:
        with cuda_ipc.torch.shareable(pub):
            tensors = {"w%d" % k: torch.ones(s // 4, device="cuda")
                       for k, s in enumerate(weight_set_sizes(args.count, args.total))}
        torch.cuda.synchronize()
        rc = 0
        if not args.publish_only:
            pub.publish_state_dict(SET, tensors)
            rc = subprocess.call([sys.executable, "-u", os.path.abspath(__file__), "--consumer", path,
                                  "--device", str(args.device), "--reps", str(args.reps),
                                  "--count", str(args.count)])
            pub.unpublish(SET, timeout=30)
        if args.publish_reps > 0:
            publish_parts(pub, tensors, args.publish_reps)
        del tensors
    except Exception as e:
        emit({"kind": "error", "message": "%s: %s" % (type(e).__name__, e)})
        return 1
    finally:
        pub.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
