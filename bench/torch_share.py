#!/usr/bin/env python3
"""PyTorch anchor for `cuda-ipc bench`.

Measures torch.multiprocessing's hand-off of CUDA tensors between two
processes, the way `cuda-ipc bench` measures its own, and prints one JSON
object per line on standard output for the bench to read:

  {"kind": "hello", "torch": ..., "cuda": ..., "device": ..., "python": ...}
  {"kind": "skip", "reason": ...}          no torch, or torch without CUDA
  {"kind": "startup", "consumer_ms": ...}  the consumer's start (CUDA included)
  {"kind": "result", "mode": "fresh"|"repeat", "size": BYTES, "warmup": W,
   "samples_ms": [...], "verify_failures": N}
  {"kind": "error", "message": ...}
  {"kind": "done", "elapsed_s": ...}

Method (one way, CLOCK_MONOTONIC in both processes, which one machine
shares):
  fresh:  the producer makes a new int32 tensor each sample (torch.full, then
          torch.cuda.synchronize(): not timed), reads the clock, puts it on a
          torch.multiprocessing Queue (spawn start method); the consumer's
          Queue.get() returns the rebuilt tensor, it synchronises its current
          stream (which waits on the producer's event) and reads the clock;
          then, not timed, it checks two values, drops the tensor and answers.
          The producer keeps its tensor until that answer (PyTorch requires
          the producer to outlive the consumer's use), then drops it and
          collects the IPC memory (torch.cuda.ipc_collect()).
  repeat: the same tensor, refilled each sample, put on the queue again.

Usage: torch_share.py --device 0 --plan SIZE:WARMUP:REPS[,SIZE:WARMUP:REPS...]
Torch is imported lazily, so --help works without it.
"""

import argparse
import json
import sys
import time
import traceback

READY_TIMEOUT_S = 300.0
ANSWER_TIMEOUT_S = 120.0


def now_ns():
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def value_for(size_index, i):
    """A distinct int32 value per sample, so a stale tensor is caught."""
    return (size_index * 1000003 + i * 7919 + 1) % (2**31 - 1)


def consumer_main(requests, answers, device):
    """The consumer process (started with the spawn method, so it must be
    importable from this module)."""
    try:
        started = now_ns()
        import torch

        torch.cuda.set_device(device)
        torch.zeros(1, device=torch.device("cuda", device))
        torch.cuda.synchronize()
        answers.put(("ready", (now_ns() - started) / 1e6))
        while True:
            msg = requests.get()
            if msg is None:
                break
            i, expect, tensor = msg
            torch.cuda.current_stream().synchronize()
            t_done = now_ns()
            ok = int(tensor[0].item()) == expect and int(tensor[-1].item()) == expect
            del tensor, msg
            answers.put(("done", i, t_done, ok))
    except BaseException:  # report anything, then end
        try:
            answers.put(("error", traceback.format_exc()))
        except BaseException:
            pass


def parse_plan(text):
    plan = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        fields = part.split(":")
        if len(fields) != 3:
            raise ValueError("plan entries are SIZE:WARMUP:REPS, got %r" % part)
        size, warmup, reps = (int(f) for f in fields)
        if size <= 0 or size % 4 != 0 or warmup < 0 or reps <= 0:
            raise ValueError("bad plan entry %r" % part)
        plan.append((size, warmup, reps))
    if not plan:
        raise ValueError("the plan is empty")
    return plan


def wait_answer(answers, process, what, timeout_s=ANSWER_TIMEOUT_S):
    import queue

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            msg = answers.get(timeout=1.0)
        except queue.Empty:
            if not process.is_alive():
                raise RuntimeError(
                    "the consumer exited (code %s) while waiting for %s" % (process.exitcode, what)
                )
            if time.monotonic() > deadline:
                raise RuntimeError("no answer from the consumer within %.0f s for %s" % (timeout_s, what))
            continue
        if msg[0] == "error":
            raise RuntimeError("the consumer failed:\n" + msg[1])
        return msg


def measure(torch, requests, answers, process, dev, size_index, size, warmup, reps, mode):
    n = size // 4
    samples = []
    failures = 0
    kept = None
    if mode == "repeat":
        kept = torch.empty(n, dtype=torch.int32, device=dev)
    for i in range(warmup + reps):
        expect = value_for(size_index, i)
        if mode == "fresh":
            tensor = torch.full((n,), expect, dtype=torch.int32, device=dev)
        else:
            kept.fill_(expect)
            tensor = kept
        torch.cuda.synchronize()
        t0 = now_ns()
        requests.put((i, expect, tensor))
        msg = wait_answer(answers, process, "%s sample %d of %d bytes" % (mode, i, size))
        _, j, t_done, ok = msg
        if j != i:
            raise RuntimeError("the consumer answered sample %d, expected %d" % (j, i))
        if i >= warmup:
            samples.append((t_done - t0) / 1e6)
            if not ok:
                failures += 1
        del tensor
        if mode == "fresh":
            torch.cuda.ipc_collect()
    del kept
    torch.cuda.ipc_collect()
    emit(
        {
            "kind": "result",
            "mode": mode,
            "size": size,
            "warmup": warmup,
            "samples_ms": samples,
            "verify_failures": failures,
        }
    )


def main():
    parser = argparse.ArgumentParser(
        description="PyTorch anchor for cuda-ipc bench: torch.multiprocessing hand-off of CUDA tensors."
    )
    parser.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    parser.add_argument(
        "--plan",
        default="2097152:5:30,67108864:5:30",
        help="comma-separated SIZE:WARMUP:REPS (bytes, thrown-away samples, kept samples)",
    )
    parser.add_argument(
        "--modes", default="fresh,repeat", help="comma-separated modes: fresh, repeat"
    )
    args = parser.parse_args()
    try:
        plan = parse_plan(args.plan)
    except ValueError as e:
        emit({"kind": "error", "message": str(e)})
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    started = time.monotonic()
    try:
        import torch
        import torch.multiprocessing as mp
    except Exception as e:  # no torch here: the bench reports the anchor as skipped
        emit({"kind": "skip", "reason": "PyTorch is not importable: %s" % e})
        return 0
    if not torch.cuda.is_available():
        emit({"kind": "skip", "reason": "PyTorch %s sees no CUDA device" % torch.__version__})
        return 0
    if args.device >= torch.cuda.device_count():
        emit(
            {
                "kind": "error",
                "message": "device %d asked for, PyTorch sees %d" % (args.device, torch.cuda.device_count()),
            }
        )
        return 1

    torch.cuda.set_device(args.device)
    dev = torch.device("cuda", args.device)
    emit(
        {
            "kind": "hello",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(args.device),
            "python": sys.version.split()[0],
        }
    )
    ctx = mp.get_context("spawn")
    requests = ctx.Queue()
    answers = ctx.Queue()
    process = ctx.Process(target=consumer_main, args=(requests, answers, args.device), daemon=True)
    process.start()
    try:
        msg = wait_answer(answers, process, "its start", READY_TIMEOUT_S)
        emit({"kind": "startup", "consumer_ms": msg[1]})
        for size_index, (size, warmup, reps) in enumerate(plan):
            for mode in modes:
                measure(torch, requests, answers, process, dev, size_index, size, warmup, reps, mode)
        requests.put(None)
        process.join(timeout=30)
    except Exception as e:
        emit({"kind": "error", "message": "%s: %s" % (type(e).__name__, e)})
        traceback.print_exc()
        if process.is_alive():
            process.terminate()
        return 1
    emit({"kind": "done", "elapsed_s": time.monotonic() - started})
    return 0


if __name__ == "__main__":
    sys.exit(main())
