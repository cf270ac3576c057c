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
  {"kind": "result", "mode": "set_list"|"set_bucket", "size": TOTAL_BYTES,
   "count": TENSORS, "warmup": W, "samples_ms": [...], "verify_failures": N,
   "extra_device_bytes": B}
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

Weight sets (--sets COUNT:TOTAL:WARMUP:REPS,...): COUNT fp32 tensors of
TOTAL bytes together, their sizes drawn by weight_set_sizes() below (the
library's cuda_ipc::set::weight_sizes with the same seed: the bench's Rust
side draws the same list, see its weights.rs). The tensors are
allocated once, as a trainer's parameters are; each sample refills every
tensor with its own value (torch.Tensor.fill_, then torch.cuda.synchronize():
not timed).
  set_list:   the clock starts, the producer puts the list of tensors on the
              queue; the consumer's Queue.get() returns the rebuilt list, it
              synchronises its current stream and reads the clock.
  set_bucket: the clock starts, the producer packs the tensors into one
              (torch.cat: the "flattened bucket"), puts that one tensor on
              the queue; the consumer's Queue.get() returns it, the consumer
              splits it back into views (torch.split with the sizes it was
              given before the measurement), synchronises and reads the clock.
  Then, not timed, the consumer checks the first and last value of every
  tensor (one gather and one copy to the host), drops them and answers; the
  producer drops what it put (the bucket) and calls torch.cuda.ipc_collect().
  extra_device_bytes: the most device memory the producer allocated during a
  sample beyond the weights themselves (torch.cuda.max_memory_allocated after
  reset_peak_memory_stats, minus memory_allocated before the clock): the
  bucket's copy for set_bucket, 0 for set_list.

Usage: torch_share.py --device 0 --plan SIZE:WARMUP:REPS[,SIZE:WARMUP:REPS...]
       torch_share.py --device 0 --sets COUNT:TOTAL:WARMUP:REPS[,...]
       torch_share.py --print-sizes COUNT:TOTAL   (the drawn sizes as JSON; no torch)
Torch is imported lazily, so --help and --print-sizes work without it.
"""

import argparse
import json
import os
import sys
import time
import traceback

READY_TIMEOUT_S = 300.0
ANSWER_TIMEOUT_S = 120.0


def now_ns():
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def awake_spin_s(environ=None):
    """CUDA_IPC_BENCH_AWAKE_US, as the bench reads it (which refuses a bad
    value before it starts this script): seconds a process waiting for the
    other's next message polls for it before it sleeps, whole microseconds up
    to 50,000; unset, empty or anything else, 0 (it sleeps at once)."""
    environ = os.environ if environ is None else environ
    text = environ.get("CUDA_IPC_BENCH_AWAKE_US", "").strip()
    if not text.isdigit() or int(text) > 50_000:
        return 0.0
    return int(text) / 1e6


def get_polling(q, spin_s, timeout=None):
    """``q.get(timeout=timeout)``, after polling ``q`` for up to ``spin_s``
    (awake_spin_s) so that a message that comes within it finds this
    process awake."""
    import queue

    end = time.perf_counter() + spin_s
    while time.perf_counter() < end:
        try:
            return q.get_nowait()
        except queue.Empty:
            pass
    return q.get(timeout=timeout)


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def value_for(size_index, i):
    """A distinct int32 value per sample, so a stale tensor is caught."""
    return (size_index * 1000003 + i * 7919 + 1) % (2**31 - 1)


# The weight-set draw, the library's cuda_ipc::set::weight_sizes (and the
# bench's weights.rs): every side must give the same list, and each side has
# a test that pins it.
WEIGHT_SET_SEED = 0x5E75EED
_MASK64 = (1 << 64) - 1


def splitmix64(state):
    """One step of splitmix64: (next state, output), both 64-bit."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def weight_set_sizes(count, total, seed=WEIGHT_SET_SEED):
    """The byte sizes of a weight set of `count` fp32 tensors totalling
    `total` bytes (a multiple of 4, at least 4 per tensor).

    Rule: a weight w_i = 1 + x_i % 1000 per tensor, x_i the successive
    outputs of splitmix64 seeded with `seed`; with E = total / 4 elements,
    tensor i gets 1 + (E - count) * w_i // sum(w) elements; the elements the
    rounding left go to the largest tensor (the last of the largest). Sizes
    are elements * 4 bytes and sum to `total` exactly.
    """
    if count <= 0 or count > 100000:
        raise ValueError("a weight set has 1 to 100000 tensors, not %d" % count)
    if total % 4 != 0 or total < 4 * count:
        raise ValueError(
            "%d bytes is not a multiple of 4 of at least %d (one fp32 element per tensor)"
            % (total, 4 * count)
        )
    state = seed
    weights = []
    for _ in range(count):
        state, x = splitmix64(state)
        weights.append(1 + x % 1000)
    elems = total // 4
    rest = elems - count
    wsum = sum(weights)
    got = [1 + rest * w // wsum for w in weights]
    largest = max(range(count), key=lambda i: (got[i], i))
    got[largest] += elems - sum(got)
    return [e * 4 for e in got]


def set_value(set_index, i, j):
    """The fp32 value of tensor j in sample i of weight set `set_index`: a
    whole number below 2**24, so exactly representable."""
    return float((set_index * 7919 + i * 104729 + j * 31 + 1) % (1 << 24))


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
        numels = None
        set_index = 0
        spin = awake_spin_s()
        while True:
            msg = get_polling(requests, spin)
            if msg is None:
                break
            if msg[0] == "set_begin":
                _, set_index, numels = msg
                answers.put(("set_ready",))
                continue
            if msg[0] == "set":
                _, i, payload = msg
                if isinstance(payload, list):
                    tensors = payload
                else:  # the flattened bucket: back into views
                    tensors = torch.split(payload, numels)
                torch.cuda.current_stream().synchronize()
                t_done = now_ns()
                ok = len(tensors) == len(numels) and all(
                    t.numel() == n for t, n in zip(tensors, numels)
                )
                if ok:
                    firsts = torch.stack([t[0] for t in tensors]).cpu().tolist()
                    lasts = torch.stack([t[-1] for t in tensors]).cpu().tolist()
                    want = [set_value(set_index, i, j) for j in range(len(numels))]
                    ok = firsts == want and lasts == want
                del tensors, payload, msg
                answers.put(("done", i, t_done, ok))
                continue
            _, i, expect, tensor = msg
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


def parse_sets(text):
    sets = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        fields = part.split(":")
        if len(fields) != 4:
            raise ValueError("set entries are COUNT:TOTAL:WARMUP:REPS, got %r" % part)
        count, total, warmup, reps = (int(f) for f in fields)
        if warmup < 0 or reps <= 0:
            raise ValueError("bad set entry %r" % part)
        weight_set_sizes(count, total)  # raises on a count or total it cannot draw
        sets.append((count, total, warmup, reps))
    if not sets:
        raise ValueError("--sets is empty")
    return sets


def wait_answer(answers, process, what, timeout_s=ANSWER_TIMEOUT_S):
    import queue

    deadline = time.monotonic() + timeout_s
    spin = awake_spin_s()
    while True:
        try:
            msg = get_polling(answers, spin, timeout=1.0)
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
        requests.put(("one", i, expect, tensor))
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


def measure_set(torch, requests, answers, process, dev, set_index, count, total, warmup, reps, mode):
    numels = [b // 4 for b in weight_set_sizes(count, total)]
    weights = [torch.empty(n, dtype=torch.float32, device=dev) for n in numels]
    requests.put(("set_begin", set_index, numels))
    wait_answer(answers, process, "the start of a %d-tensor set" % count)
    samples = []
    failures = 0
    extra = 0
    for i in range(warmup + reps):
        for j, w in enumerate(weights):
            w.fill_(set_value(set_index, i, j))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        t0 = now_ns()
        if mode == "set_list":
            payload = weights
        else:
            payload = torch.cat(weights)
        requests.put(("set", i, payload))
        msg = wait_answer(answers, process, "%s sample %d of %d tensors" % (mode, i, count))
        _, j, t_done, ok = msg
        if j != i:
            raise RuntimeError("the consumer answered sample %d, expected %d" % (j, i))
        extra = max(extra, torch.cuda.max_memory_allocated(dev) - before)
        if i >= warmup:
            samples.append((t_done - t0) / 1e6)
            if not ok:
                failures += 1
        del payload
        torch.cuda.ipc_collect()
    del weights
    torch.cuda.ipc_collect()
    emit(
        {
            "kind": "result",
            "mode": mode,
            "size": total,
            "count": count,
            "warmup": warmup,
            "samples_ms": samples,
            "verify_failures": failures,
            "extra_device_bytes": extra,
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
        "--sets",
        default="",
        help="comma-separated COUNT:TOTAL:WARMUP:REPS: weight sets of COUNT fp32 tensors "
        "totalling TOTAL bytes (the set modes)",
    )
    parser.add_argument(
        "--modes",
        default=None,
        help="comma-separated modes: fresh, repeat (per --plan size), set_list, set_bucket "
        "(per --sets entry); default fresh,repeat, or set_list,set_bucket with --sets",
    )
    parser.add_argument(
        "--print-sizes",
        metavar="COUNT:TOTAL",
        help="print the drawn byte sizes of a weight set as a JSON list and exit (no torch)",
    )
    args = parser.parse_args()
    if args.print_sizes is not None:
        try:
            count, total = (int(f) for f in args.print_sizes.split(":"))
            sys.stdout.write(json.dumps(weight_set_sizes(count, total)) + "\n")
        except ValueError as e:
            sys.stderr.write("--print-sizes %s: %s\n" % (args.print_sizes, e))
            return 2
        return 0
    if args.modes is None:
        args.modes = "set_list,set_bucket" if args.sets else "fresh,repeat"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    known = ("fresh", "repeat", "set_list", "set_bucket")
    try:
        unknown = [m for m in modes if m not in known]
        if unknown:
            raise ValueError("unknown mode %r; choose from %s" % (unknown[0], ", ".join(known)))
        size_modes = [m for m in modes if m in ("fresh", "repeat")]
        set_modes = [m for m in modes if m in ("set_list", "set_bucket")]
        plan = parse_plan(args.plan) if size_modes else []
        sets = parse_sets(args.sets) if set_modes else []
    except ValueError as e:
        emit({"kind": "error", "message": str(e)})
        return 2

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
            for mode in size_modes:
                measure(torch, requests, answers, process, dev, size_index, size, warmup, reps, mode)
        for set_index, (count, total, warmup, reps) in enumerate(sets):
            for mode in set_modes:
                measure_set(
                    torch, requests, answers, process, dev, set_index, count, total, warmup, reps, mode
                )
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
