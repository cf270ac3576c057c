#!/usr/bin/env python3
"""Loads and saves of the weight service against the link, for the
bundle's `service-io` step (issue 57, items 2 and 3): the 4.37 GB
Qwen2-shaped bfloat16 checkpoint of load_checkpoint.py, loaded by a
`cuda-ipc serve --service` (`cuda-ipc load`) at several copy settings,
saved back as safetensors (`cuda-ipc save`) to tmpfs and to the disk, and
served again from what was saved (`serve --service --restore`), with the
physical floor and what users run today measured in the same run. JSON
lines, then one line per target with its verdict:

  {"kind": "hello", ...} / {"kind": "skip", "reason": ...}
  {"kind": "floor", "h2d_gb_per_s": X, "d2h_gb_per_s": Y, "bytes": B}
  {"kind": "result", "mode": M, "gb_per_s": [...], "seconds": [...], ...}
  {"kind": "target", "name": ..., "measured": ..., "anchor": ..., "ratio": ..., "met": bool}
  {"kind": "done", "elapsed_s": S}

Modes:
  floor: a 1 GiB pinned host tensor copied to the device and back
      (`copy_(non_blocking=True)` then synchronise), best of 5 each way.
  safetensors_load: `safetensors.torch.load_file(shard, device=cuda)` of
      every shard (the anchor users run today).
  torch_pinned_load: PyTorch's own loop: each shard read (`readinto`) into
      one pinned buffer, then copied to the device (`non_blocking`), shard
      by shard.
  service_load: `cuda-ipc load` into a running service; the service's own
      `gb_per_s` (first allocation to last copy) and the call's wall time;
      one row per STREAMS:STAGING setting (`--configs`).
  service_save: `cuda-ipc save` of the loaded set to a directory, its own
      `gb_per_s` (file creation to rename, fsync included) and the call's
      wall time; to tmpfs (/dev/shm: the link's row) and to the disk's
      DIR (the disk's row, with `dd` writing the same bytes with fsync
      beside it). Every saved tensor is compared with the checkpoint's.
  safetensors_save: the anchor: `safetensors.torch.save_file` of the same
      tensors from the GPU (a reader's read-only state dict) to tmpfs.
  restore: `serve --service --restore DIR` of the tmpfs save: the load
      time it reports, the set's version, its bytes checked by `cuda-ipc
      attach --set --checkpoint` against the original checkpoint.

Targets (issue 57): service_load best >= 0.90 x h2d floor; service_save
to tmpfs best >= 0.80 x d2h floor; both ahead of their anchors.

Usage: service_io.py --cli PATH [--dir DIR] [--device 0] [--reps 3]
                     [--configs 8:2MiB,4:16MiB,8:16MiB,16:8MiB]
                     [--save-configs default,8:8MiB,16:4MiB]
"""

import argparse
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_checkpoint import check, warm, write_checkpoint  # noqa: E402
from service_model import Service  # noqa: E402
from torch_share import emit  # noqa: E402

SET = "model"
LOAD_TIMEOUT_S = 600


def best(xs):
    return max(xs) if xs else 0.0


def floors(torch, device, reps=5):
    """Pinned host <-> device copies of 1 GiB: (h2d, d2h) GB/s, best of ``reps``."""
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda:%d" % device)
    rates = {"h2d": [], "d2h": []}
    for _ in range(reps):
        for way, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
            torch.cuda.synchronize()
            t0 = time.monotonic()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            rates[way].append(n / (time.monotonic() - t0) / 1e9)
    del host, dev
    torch.cuda.empty_cache()
    return best(rates["h2d"]), best(rates["d2h"])


def timed(torch, fn):
    torch.cuda.synchronize()
    t0 = time.monotonic()
    out = fn()
    torch.cuda.synchronize()
    return time.monotonic() - t0, out


def safetensors_load(torch, files, device):
    from safetensors.torch import load_file

    loaded = {}
    for path in files:
        loaded.update(load_file(path, device="cuda:%d" % device))
    return loaded


def torch_pinned_load(torch, files, device):
    """PyTorch's own loop: each shard read into one pinned buffer, copied
    to the device whole, its tensors views of that copy."""
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    loaded, dev = {}, "cuda:%d" % device
    pinned = torch.empty(max(os.path.getsize(p) for p in files), dtype=torch.uint8, pin_memory=True)
    for path in files:
        with open(path, "rb") as f:
            n = f.readinto(memoryview(pinned.numpy())[: os.path.getsize(path)])
        whole = pinned[:n].to(dev, non_blocking=True)
        header_len = struct.unpack("<Q", pinned[:8].numpy().tobytes())[0]
        header = json.loads(pinned[8:8 + header_len].numpy().tobytes())
        torch.cuda.synchronize()  # the buffer is read again for the next shard
        base = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            loaded[name] = whole[base + start:base + end].view(dtypes[info["dtype"]]).view(info["shape"])
    del pinned
    return loaded


def run_cli(cli, args, timeout=LOAD_TIMEOUT_S):
    t0 = time.monotonic()
    p = subprocess.run([cli] + args, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - t0
    answer = None
    for line in p.stdout.splitlines():
        try:
            answer = json.loads(line)
        except ValueError:
            pass
    if p.returncode != 0:
        raise RuntimeError("cuda-ipc %s exited %d: %s" % (args[0], p.returncode, (p.stdout + p.stderr)[-600:]))
    return wall, answer


def compare_saved(torch, saved_path, files):
    """How many tensors of the saved file differ from the checkpoint's (CPU)."""
    from safetensors.torch import load_file

    saved = load_file(saved_path)
    original = {}
    for path in files:
        original.update(load_file(path))
    bad = sum(not torch.equal(saved.get(k, torch.empty(0)), v) for k, v in original.items())
    return bad + len(set(saved) - set(original))


def dd_rate(folder, nbytes):
    """The disk's own write rate for ``nbytes`` (dd, fsync at the end), GB/s."""
    path = os.path.join(folder, "dd.bin")
    t0 = time.monotonic()
    p = subprocess.run(["dd", "if=/dev/zero", "of=" + path, "bs=64M", "count=%d" % max(1, nbytes >> 26),
                        "conv=fsync"], capture_output=True)
    s = time.monotonic() - t0
    os.unlink(path)
    return (max(1, nbytes >> 26) << 26) / s / 1e9 if p.returncode == 0 else None


def target(name, measured, anchor, want):
    ratio = measured / anchor if anchor else 0.0
    met = ratio >= want
    emit({"kind": "target", "name": name, "measured": round(measured, 3), "anchor": round(anchor, 3),
          "ratio": round(ratio, 3), "want": want, "met": met})
    return met


def run(args, torch, folder):
    h2d, d2h = floors(torch, args.device)
    emit({"kind": "floor", "h2d_gb_per_s": round(h2d, 2), "d2h_gb_per_s": round(d2h, 2), "bytes": 1 << 30})
    files = sorted(glob.glob(os.path.join(args.dir, "*.safetensors")))
    total = args.total
    for mode, fn in (("safetensors_load", safetensors_load), ("torch_pinned_load", torch_pinned_load)):
        secs, bad = [], 0
        for _ in range(args.reps):
            s, loaded = timed(torch, lambda: fn(torch, files, args.device))
            secs.append(s)
            bad += check(torch, loaded, args.expect) != 0
            del loaded
            torch.cuda.empty_cache()
        emit({"kind": "result", "mode": mode, "seconds": secs, "gb_per_s": [total / s / 1e9 for s in secs],
              "verify_failures": bad})
        args.anchors[mode] = best([total / s / 1e9 for s in secs])
    sock = os.path.join(folder, "svc.sock")
    svc = Service(args.cli, sock, os.path.join(folder, "service.log"), args.device, extra=["--no-keeper"])
    try:
        ours = []
        for cfg in args.configs:
            streams, staging = cfg.split(":")
            for _ in range(args.reps):
                wall, ans = run_cli(args.cli, ["load", "--json", "--service", sock, "--set", SET,
                                               "--streams", streams, "--staging", staging, args.dir])
                ours.append(ans["gb_per_s"])
                emit({"kind": "result", "mode": "service_load", "config": cfg, "gb_per_s": [ans["gb_per_s"]],
                      "seconds": [ans["load_s"]], "wall_s": wall})
                run_cli(args.cli, ["drop", "--service", sock, SET])
        run_cli(args.cli, ["load", "--service", sock, "--set", SET, args.dir])
        saves = {}
        for where, dest in (("tmpfs", args.shm), ("disk", os.path.join(folder, "saved"))):
            os.makedirs(dest, exist_ok=True)
            rates = []
            for cfg in (args.save_configs if where == "tmpfs" else ["default"]):
                extra = []
                if cfg != "default":
                    n, staging = cfg.split(":")
                    extra = ["--streams", n, "--staging", staging]
                for _ in range(args.reps):
                    wall, ans = run_cli(args.cli, ["save", "--json", "--force", "--service", sock,
                                                   "--set", SET] + extra + [dest])
                    rates.append(ans["gb_per_s"])
                    emit({"kind": "result", "mode": "service_save", "to": where, "config": cfg,
                          "gb_per_s": [ans["gb_per_s"]], "seconds": [ans["save_s"]], "wall_s": wall,
                          "path": ans["path"], "written": ans.get("written"),
                          "parts_s": {k: ans.get(k + "_s") for k in ("reserve", "copy", "flush")}})
            bad = compare_saved(torch, ans["path"], files)
            row = {"kind": "result", "mode": "service_save_checked", "to": where, "verify_failures": bad}
            if where == "disk":
                row["dd_fsync_gb_per_s"] = dd_rate(dest, total)
            emit(row)
            saves[where] = best(rates)
        import cuda_ipc
        from cuda_ipc import service
        from safetensors.torch import save_file

        with service.Reader(sock, device=args.device) as reader:
            sd = reader.attach_state_dict(SET)
            tensors = {k: v for k, v in sd.items()}
            out = os.path.join(args.shm, "anchor.safetensors")
            secs = []
            for _ in range(args.reps):
                s, _ = timed(torch, lambda: save_file(tensors, out, metadata={"format": "pt"}))
                secs.append(s)
            os.unlink(out)
            tensors = sd = None  # the lease goes with the reader
        emit({"kind": "result", "mode": "safetensors_save", "to": "tmpfs", "seconds": secs,
              "gb_per_s": [total / s / 1e9 for s in secs], "cuda_ipc": cuda_ipc.__version__})
        args.anchors["safetensors_save"] = best([total / s / 1e9 for s in secs])
    finally:
        emit({"kind": "stopped", "exit": svc.stop(), "output": svc.tail()})
    # Served again from the tmpfs save.
    restored = Service(args.cli, sock, os.path.join(folder, "restore.log"), args.device,
                       extra=["--no-keeper", "--restore", args.shm])
    try:
        line = restored.first_json(LOAD_TIMEOUT_S)
        rows = line.get("restored_from_disk", [])
        p = subprocess.run([args.cli, "attach", "--socket", sock, "--set", SET, "--checkpoint", args.dir],
                           capture_output=True, text=True, timeout=LOAD_TIMEOUT_S)
        emit({"kind": "result", "mode": "restore", "rows": rows, "attach_exit": p.returncode,
              "attach": (p.stdout + p.stderr).strip().splitlines()[-1:]})
    finally:
        emit({"kind": "stopped", "exit": restored.stop(), "output": restored.tail()})
    met = [
        target("load >= 0.90 x pinned H2D", best(ours), h2d, 0.90),
        target("load ahead of safetensors load_file", best(ours), args.anchors["safetensors_load"], 1.0),
        target("load ahead of PyTorch's pinned loop", best(ours), args.anchors["torch_pinned_load"], 1.0),
        target("save to tmpfs >= 0.80 x pinned D2H", saves["tmpfs"], d2h, 0.80),
        target("save ahead of safetensors save_file", saves["tmpfs"], args.anchors["safetensors_save"], 1.0),
    ]
    return all(met)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cli", required=True, help="the cuda-ipc executable")
    ap.add_argument("--dir", help="checkpoint folder (written here if not given)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", default="8:2MiB,4:16MiB,8:16MiB,16:8MiB",
                    help="STREAMS:STAGING settings of the service's loads, comma-separated")
    ap.add_argument("--save-configs", default="default,8:8MiB,16:4MiB",
                    help="STREAMS:STAGING settings of the saves to tmpfs (default: the saver's)")
    args = ap.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    args.save_configs = [c for c in args.save_configs.split(",") if c]
    started = time.time()
    try:
        import cuda_ipc  # noqa: F401
        import safetensors  # noqa: F401
        import torch
    except ImportError as e:
        emit({"kind": "skip", "reason": "%s is not importable" % e.name})
        return 0
    if not torch.cuda.is_available() or args.device >= torch.cuda.device_count():
        emit({"kind": "skip", "reason": "PyTorch sees no CUDA device %d" % args.device})
        return 0
    torch.cuda.set_device(args.device)
    emit({"kind": "hello", "torch": torch.__version__, "device": torch.cuda.get_device_name(args.device)})
    folder = tempfile.mkdtemp(prefix="cuda-ipc-service-io-")
    args.shm = tempfile.mkdtemp(prefix="cuda-ipc-save-", dir="/dev/shm")
    args.dir = args.dir or os.path.join(folder, "ckpt")
    args.anchors = {}
    try:
        files, expect, _, total = write_checkpoint(torch, args.dir, int(2e9), args.device)
        os.sync()
        warm(files)
        args.expect, args.total = expect, total
        emit({"kind": "written", "dir": args.dir, "files": len(files), "tensors": len(expect), "bytes": total})
        ok = run(args, torch, folder)
    except Exception as e:
        emit({"kind": "error", "message": "%s: %s" % (type(e).__name__, e), "trace": traceback.format_exc()})
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(args.shm, ignore_errors=True)
    emit({"kind": "done", "elapsed_s": time.time() - started, "all_met": ok})
    return 0


if __name__ == "__main__":
    sys.exit(main())
