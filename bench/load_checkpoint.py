#!/usr/bin/env python3
"""Loading a checkpoint from the page cache, for the bundle's `load` step
(issue 26's loader target): writes the Qwen2-shaped bfloat16 model of
first_attach.py (about 4.37 GB, the tied output projection saved once, as
transformers saves it) as a sharded Hugging Face checkpoint
(`model-0000K-of-0000N.safetensors` + `model.safetensors.index.json`), and
times the anchor, `safetensors.torch.load_file(shard, device="cuda:N")` of
every shard, from the page cache. `cuda-ipc serve --checkpoint DIR` is the
other side, timed by itself in the same run (run.sh). JSON lines:

  {"kind": "hello", "torch": ..., "safetensors": ..., "device": ...}
  {"kind": "skip", "reason": ...}          no torch, no CUDA or no safetensors
  {"kind": "written", "dir": DIR, "files": N, "tensors": T, "bytes": B,
   "source": ..., "write_s": S}
  {"kind": "result", "mode": "safetensors_load", "size": B, "count": T,
   "samples_ms": [...], "gb_per_s": [...], "verify_failures": N}
  {"kind": "error", "message": ...}

Method: every tensor holds first_attach.py's pattern (whole numbers below
251, exact in bfloat16), made on the GPU and copied to the host to be
written; the files are then read once (page cache warm). Each sample loads
every shard with `load_file` onto the device and synchronises; the clock
runs from before the first load to after the synchronise; then, not timed,
every tensor's sum is compared with the pattern's (float64, exact).

Usage: load_checkpoint.py --dir DIR [--device 0] [--reps 3] [--shard-gb 2]
"""

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from first_attach import fill_pattern, model_shapes, numel, pattern_sum  # noqa: E402
from torch_share import emit  # noqa: E402


def write_checkpoint(torch, folder, shard_bytes, device):
    """Writes the model as shards of at most ``shard_bytes`` (whole
    tensors) and the index; returns ``(files, expect, source)`` where
    ``expect`` is ``{key: sum}``."""
    from safetensors.torch import save_file

    shapes, ties, source = model_shapes(torch)
    unique = [(k, s) for k, s in shapes if k not in ties]
    groups, size = [[]], 0
    for key, shape in unique:
        n = numel(shape) * 2
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((key, shape))
        size += n
    expect, weight_map, files, k = {}, {}, [], 0
    os.makedirs(folder, exist_ok=True)
    for g, group in enumerate(groups):
        name = "model-%05d-of-%05d.safetensors" % (g + 1, len(groups))
        tensors = {}
        for key, shape in group:
            t = torch.empty(shape, dtype=torch.bfloat16, device="cuda:%d" % device)
            fill_pattern(torch, t, k)
            tensors[key] = t.cpu()
            expect[key] = pattern_sum(numel(shape), k)
            weight_map[key] = name
            k += 1
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        files.append(os.path.join(folder, name))
        del tensors
    total = sum(numel(s) * 2 for _, s in unique)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return files, expect, source, total


def warm(files):
    """Reads every file once, so that the loads come from the page cache."""
    for path in files:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def check(torch, loaded, expect):
    """How many tensors of ``loaded`` miss or differ from ``expect``."""
    keys = sorted(expect)
    if any(k not in loaded for k in keys):
        return sum(k not in loaded for k in keys)
    sums = torch.stack([loaded[k].sum(dtype=torch.float64) for k in keys]).tolist()
    return sum(int(s) != expect[k] for s, k in zip(sums, keys))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        emit({"kind": "skip", "reason": "torch is not importable (%s)" % e})
        return 0
    try:
        import safetensors
        from safetensors.torch import load_file
    except ImportError as e:
        emit({"kind": "skip", "reason": "safetensors is not importable (%s)" % e})
        return 0
    if not torch.cuda.is_available() or args.device >= torch.cuda.device_count():
        emit({"kind": "skip", "reason": "PyTorch sees no CUDA device %d" % args.device})
        return 0
    torch.cuda.set_device(args.device)
    emit({"kind": "hello", "torch": torch.__version__, "safetensors": safetensors.__version__,
          "device": torch.cuda.get_device_name(args.device)})
    try:
        t = time.monotonic()
        files, expect, source, total = write_checkpoint(torch, args.dir, int(args.shard_gb * 1e9), args.device)
        os.sync()
        warm(files)
        emit({"kind": "written", "dir": args.dir, "files": len(files), "tensors": len(expect),
              "bytes": total, "source": source, "write_s": round(time.monotonic() - t, 3)})
        samples, failures = [], 0
        dev = "cuda:%d" % args.device
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.monotonic_ns()
            loaded = {}
            for path in files:
                loaded.update(load_file(path, device=dev))
            torch.cuda.synchronize()
            samples.append((time.monotonic_ns() - t0) / 1e6)
            failures += check(torch, loaded, expect) != 0
            del loaded
            torch.cuda.empty_cache()
        emit({"kind": "result", "mode": "safetensors_load", "size": total, "count": len(expect),
              "samples_ms": samples, "gb_per_s": [round(total / (ms * 1e6), 3) for ms in samples],
              "verify_failures": failures})
    except Exception as e:
        emit({"kind": "error", "message": "%s: %s" % (type(e).__name__, e), "trace": traceback.format_exc()})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
