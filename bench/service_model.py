#!/usr/bin/env python3
"""A transformers model from the weight service, for the bundle's
`service-model` step (issue 26's first targets): the Qwen2-shaped bfloat16
model of first_attach.py (about 4.37 GB) is written as a sharded Hugging
Face checkpoint with its `config.json`, loaded into a `cuda-ipc serve
--service` by `cuda-ipc load`, and then made a working transformers model
in fresh processes. JSON lines:

  {"kind": "hello", "cuda_ipc": ..., "torch": ..., "transformers": ..., "device": ...}
  {"kind": "skip", "reason": ...}          no cuda_ipc, torch, transformers or CUDA
  {"kind": "written", "dir": DIR, "files": N, "tensors": T, "bytes": B, "write_s": S}
  {"kind": "loaded", "seconds": S, "output": [last lines of `cuda-ipc load`]}
  {"kind": "result", "mode": "service_model", "size": B, "count": KEYS, "warmup": W,
   "samples_ms": [...], "verify_failures": N,
   "parts_ms": {"meta": [...], "connect": [...], "attach": [...], "assign": [...],
                "sleep": [...], "wake": [...], "generate": [...]}}
  {"kind": "result", "mode": "readers_at_once", "readers": R, "samples_ms": [...],
   "single_ms": MS, "parts_ms": {...}, "single_parts_ms": {...}, "start_spread_ms": MS,
   "verify_failures": N}
  {"kind": "result", "mode": "from_pretrained", "size": B, "samples_ms": [...],
   "verify_failures": N}
  {"kind": "stopped", "exit": CODE, "output": [last lines of the service]}
  {"kind": "error", "message": ...}
  {"kind": "done", "elapsed_s": ...}

Method (CLOCK_MONOTONIC in every process):
  service_model: per sample a new Python process (the first `warmup` thrown
      away) imports torch, transformers and cuda_ipc and starts CUDA, then,
      timed apart: `meta`, the model built on the meta device from the
      checkpoint's config (`AutoModelForCausalLM.from_config`; buffers
      outside the state dict, such as the rotary embedding's, made again on
      the GPU); then the
      sample, from just before `cuda_ipc.Subscriber(SOCKET, read_only=True)`
      (`connect`) through `attach_state_dict` (`attach`: read-only tensors,
      the service's event waited for) to after
      `model.load_state_dict(sd, assign=True)` and `tie_weights()`
      (`assign`): the model is on the GPU and usable. Then, not timed:
      every parameter's sum against the pattern (float64, exact); then
      `Subscriber.sleep(unchecked=True)` and `wake()` (`sleep`, `wake`:
      every mapping unmapped and mapped again at the same addresses, the
      model's parameters kept), and a
      greedy `generate` of 4 tokens (`generate`, timed apart; the weights
      are the test pattern, so the tokens mean nothing: the check is that
      the model runs on the service's memory).
  readers_at_once: `--readers` fresh processes, all started and ready
      first, then asked at once; each times its connect + attach + assign
      as above; compared with the median single sample.
  from_pretrained: the anchor, in a new process: `AutoModelForCausalLM.
      from_pretrained(DIR, dtype=bfloat16, device_map="cuda:N")` from the
      page cache, timed from just before the call to after it returned and
      `torch.cuda.synchronize()`; the same sums checked.

Usage: service_model.py --cli PATH [--dir DIR] [--device 0] [--reps 1:5]
                        [--readers 8] [--anchors 2]
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_ipc_share import Consumer  # noqa: E402
from first_attach import QWEN2_LIKE, SET_NAME, model_shapes, parse_reps  # noqa: E402
from load_checkpoint import warm, write_checkpoint  # noqa: E402
from torch_share import emit, now_ns  # noqa: E402

# How long the service may take to start, and a load to finish.
START_TIMEOUT_S = 60
LOAD_TIMEOUT_S = 600
# The model built on `meta` the way the example does it (one definition).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "python"))
from service_generate import build_on_meta  # noqa: E402

# New tokens generated per sample (not timed with the attach).
NEW_TOKENS = 4


def param_failures(torch, model, expect):
    """How many of ``expect``'s keys the model lacks or holds with another sum."""
    sd = model.state_dict()
    keys = sorted(expect)
    if any(k not in sd for k in keys):
        return sum(k not in sd for k in keys)
    sums = torch.stack([sd[k].sum(dtype=torch.float64) for k in keys]).tolist()
    return sum(int(s) != expect[k] for s, k in zip(sums, keys))


def generate(torch, model, device):
    """Greedy `generate` of NEW_TOKENS tokens; ``(ms, new tokens made)``."""
    ids = torch.tensor([[1, 2, 3, 4]], device="cuda:%d" % device)
    with torch.inference_mode():
        t0 = now_ns()
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        torch.cuda.synchronize()
    return (now_ns() - t0) / 1e6, int(out.shape[1] - ids.shape[1])


def child_main(device, sock):
    """One fresh process: ready, one request, one answer (JSON lines)."""
    import cuda_ipc
    import torch

    torch.cuda.set_device(device)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    # transformers' import (seconds, cold) is not part of any timing: both
    # the service path and the from_pretrained anchor start after it.
    import transformers  # noqa: F401

    print(json.dumps({"ready": True, "t_ready": now_ns()}), flush=True)
    req = json.loads(sys.stdin.readline())
    ans = {}
    if req["mode"] == "from_pretrained":
        from transformers import AutoModelForCausalLM

        t0 = now_ns()
        model = AutoModelForCausalLM.from_pretrained(req["dir"], dtype=torch.bfloat16,
                                                     device_map="cuda:%d" % device)
        torch.cuda.synchronize()
        ans["ms"] = (now_ns() - t0) / 1e6
        ans["bad"] = param_failures(torch, model, req["expect"])
        print(json.dumps(ans), flush=True)
        return 0
    t_meta = now_ns()
    model = build_on_meta(torch, req["dir"], device)
    t0 = now_ns()
    sub = cuda_ipc.Subscriber(sock, device=device, timeout=30, read_only=True)
    t_conn = now_ns()
    sd = sub.attach_state_dict(req["name"])
    t_attach = now_ns()
    model.load_state_dict(sd, assign=True, strict=False)
    model.tie_weights()
    t_done = now_ns()
    ans.update({"t0_ns": t0, "meta": (t0 - t_meta) / 1e6, "connect": (t_conn - t0) / 1e6,
                "attach": (t_attach - t_conn) / 1e6, "assign": (t_done - t_attach) / 1e6,
                "ms": (t_done - t0) / 1e6, "read_only": bool(sd.read_only),
                "bad": param_failures(torch, model, req["expect"])})
    if req.get("generate"):
        # Sleep and wake (issue 26's wake target), then generate on the
        # memory mapped again at the same addresses.
        t_sleep = now_ns()
        # The model keeps its parameters across the sleep and runs nothing
        # until the wake: the unchecked sleep's promise.
        sub.sleep(unchecked=True)
        t_wake = now_ns()
        sub.wake()
        t_woke = now_ns()
        ans["sleep"], ans["wake"] = (t_wake - t_sleep) / 1e6, (t_woke - t_wake) / 1e6
        ans["generate"], ans["new_tokens"] = generate(torch, model, device)
    print(json.dumps(ans), flush=True)
    # The model's parameters hold the lease; it ends with this process.
    return 0


class Service:
    """`cuda-ipc serve --service` on socket ``sock``, its output in ``log``."""

    def __init__(self, cli, sock, log, device, extra=()):
        self.log_path = log
        self.log = open(log, "w")
        self.p = subprocess.Popen([cli, "serve", "--service", sock, "--device", str(device)] + list(extra),
                                  stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(sock):
            if self.p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the service did not start: %s" % " | ".join(self.tail()))
            time.sleep(0.05)

    def first_json(self, timeout_s):
        """The service's first JSON line (printed once it serves)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.log.flush()
            with open(self.log_path) as f:
                for line in f:
                    if line.startswith("{"):
                        return json.loads(line)
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("the service printed no JSON line: %s" % " | ".join(self.tail()))

    def tail(self, n=6):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return [line.rstrip() for line in f.readlines()[-n:]]

    def stop(self, grace_s=60):
        """SIGTERM, then the exit status (killed after ``grace_s``)."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            code = self.p.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.p.kill()
            code = "killed after %d s" % grace_s
        self.log.close()
        return code


def run_cli(cli, args, timeout):
    """``cuda-ipc ARGS``; ``(seconds, exit status, last lines)``."""
    t0 = time.monotonic()
    p = subprocess.run([cli] + args, capture_output=True, text=True, timeout=timeout)
    lines = (p.stdout + p.stderr).strip().splitlines()
    return time.monotonic() - t0, p.returncode, lines[-4:]


def ask_all(consumers, req):
    """Sends ``req`` to every consumer, then reads every answer (all at once)."""
    for c in consumers:
        c.p.stdin.write(json.dumps(req) + "\n")
        c.p.stdin.flush()
    return [c.read() for c in consumers]


def run(args, torch, folder, sock):
    """The whole measurement once the checkpoint is written; emits results."""
    warmup, reps = parse_reps(args.reps)
    shapes, ties, _ = model_shapes(torch)
    svc = Service(args.cli, sock, os.path.join(folder, "service.log"), args.device)
    try:
        secs, code, out = run_cli(args.cli, ["load", "--service", sock, "--set", SET_NAME, args.dir],
                                  LOAD_TIMEOUT_S)
        emit({"kind": "loaded", "seconds": round(secs, 3), "exit": code, "output": out})
        if code != 0:
            raise RuntimeError("cuda-ipc load exited %d: %s" % (code, " | ".join(out)))
        expect = args.expect
        base = {"name": SET_NAME, "dir": args.dir, "expect": expect}
        parts = ("meta", "connect", "attach", "assign", "sleep", "wake", "generate")
        single = {"samples": [], "failures": 0, "parts": {p: [] for p in parts}}
        for i in range(warmup + reps):
            c = Consumer(args.device, sock, script=__file__)
            try:
                c.read()
                ans = c.ask(dict(base, mode="service", generate=True))
            finally:
                c.close()
            if i < warmup:
                continue
            single["samples"].append(ans["ms"])
            bad = ans["bad"] or not ans["read_only"] or ans.get("new_tokens") != NEW_TOKENS
            single["failures"] += bool(bad)
            for p in single["parts"]:
                single["parts"][p].append(ans[p])
        emit({"kind": "result", "mode": "service_model", "size": args.total, "count": len(shapes),
              "warmup": warmup, "samples_ms": single["samples"], "verify_failures": single["failures"],
              "parts_ms": single["parts"]})
        if args.readers:
            crowd = [Consumer(args.device, sock, script=__file__) for _ in range(args.readers)]
            try:
                for c in crowd:
                    c.read()
                answers = ask_all(crowd, dict(base, mode="service", generate=False))
            finally:
                for c in crowd:
                    c.close()
            ordered = sorted(single["samples"])
            med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
            starts = [a["t0_ns"] for a in answers]
            # Each part at once beside the same part alone: where the time
            # of readers at once goes (the driver's mapping in `attach`,
            # PyTorch in `assign`, the service in `connect`).
            emit({"kind": "result", "mode": "readers_at_once", "readers": args.readers,
                  "samples_ms": [a["ms"] for a in answers], "single_ms": ordered[len(ordered) // 2],
                  "parts_ms": {p: [a[p] for a in answers] for p in ("meta", "connect", "attach", "assign")},
                  "single_parts_ms": {p: med(single["parts"][p]) for p in ("meta", "connect", "attach", "assign")},
                  "start_spread_ms": (max(starts) - min(starts)) / 1e6,
                  "verify_failures": sum(bool(a["bad"]) or not a["read_only"] for a in answers)})
        anchor = {"samples": [], "failures": 0}
        for _ in range(args.anchors):
            c = Consumer(args.device, sock, script=__file__)
            try:
                c.read()
                ans = c.ask(dict(base, mode="from_pretrained"))
            finally:
                c.close()
            anchor["samples"].append(ans["ms"])
            anchor["failures"] += bool(ans["bad"])
        emit({"kind": "result", "mode": "from_pretrained", "size": args.total, "samples_ms": anchor["samples"],
              "verify_failures": anchor["failures"]})
    finally:
        code = svc.stop()
        emit({"kind": "stopped", "exit": code, "output": svc.tail()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cli", help="the cuda-ipc executable")
    ap.add_argument("--dir", help="checkpoint folder (written if it holds no config.json)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--reps", default="1:5", help="WARMUP:REPS fresh processes (default 1:5)")
    ap.add_argument("--readers", type=int, default=8, help="readers attaching at once (0: none)")
    ap.add_argument("--anchors", type=int, default=2, help="from_pretrained processes (the anchor)")
    ap.add_argument("--consumer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.consumer:
        return child_main(args.device, args.consumer)
    if not args.cli:
        emit({"kind": "error", "message": "--cli PATH (the cuda-ipc executable) is required"})
        return 2
    try:
        parse_reps(args.reps)
        if args.readers < 0 or args.anchors < 0:
            raise ValueError("--readers and --anchors are 0 or more")
    except ValueError as e:
        emit({"kind": "error", "message": str(e)})
        return 2
    started = time.time()
    try:
        import cuda_ipc
        import torch
        import transformers
        from transformers import Qwen2Config
    except ImportError as e:
        emit({"kind": "skip", "reason": "%s is not importable" % e.name})
        return 0
    if not torch.cuda.is_available() or args.device >= torch.cuda.device_count():
        emit({"kind": "skip", "reason": "PyTorch sees no CUDA device %d" % args.device})
        return 0
    torch.cuda.set_device(args.device)
    emit({"kind": "hello", "cuda_ipc": cuda_ipc.__version__, "torch": torch.__version__,
          "transformers": transformers.__version__, "device": torch.cuda.get_device_name(args.device)})
    folder = tempfile.mkdtemp(prefix="cuda-ipc-service-model-")
    args.dir = args.dir or os.path.join(folder, "ckpt")
    try:
        t = time.monotonic()
        files, expect, _, total = write_checkpoint(torch, args.dir, int(2e9), args.device)
        Qwen2Config(**QWEN2_LIKE).save_pretrained(args.dir)
        os.sync()
        warm(files)
        args.expect, args.total = expect, total
        emit({"kind": "written", "dir": args.dir, "files": len(files), "tensors": len(expect), "bytes": total,
              "write_s": round(time.monotonic() - t, 3)})
        run(args, torch, folder, os.path.join(folder, "svc.sock"))
    except Exception as e:
        emit({"kind": "error", "message": "%s: %s" % (type(e).__name__, e), "trace": traceback.format_exc()})
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    emit({"kind": "done", "elapsed_s": time.time() - started})
    return 0


if __name__ == "__main__":
    sys.exit(main())
