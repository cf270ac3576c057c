#!/usr/bin/env python3
"""Ours from Python, for `cuda-ipc bench`: the `cuda_ipc` package (the
installed wheel) handing off between two Python processes, timed the way the
bench times the Rust side, printed as JSON lines like bench/torch_share.py:

  {"kind": "hello", "cuda_ipc": ..., "torch": ..., "device": ..., "python": ...}
  {"kind": "skip", "reason": ...}          no cuda_ipc (wheel not installed), no torch or no CUDA
  {"kind": "startup", "consumer_ms": ...}  the consumer's start (imports, CUDA, connect)
  {"kind": "result", "mode": "py_fresh", "size": BYTES, "warmup": W,
   "samples_ms": [...], "verify_failures": N, "parts_ms": {...}}
  {"kind": "result", "mode": "py_set", "size": TOTAL_BYTES, "count": TENSORS,
   "warmup": W, "samples_ms": [...], "verify_failures": N, "parts_ms": {...}}
  {"kind": "result", "mode": "py_update", "size": TOTAL_BYTES, "count": TENSORS,
   "warmup": W, "samples_ms": [...], "verify_failures": N, "parts_ms": {"update": [...]}}

  parts_ms: per kept sample, "publish" (the producer's call, from the clock's
  start to its return), "request" (from the producer's return to the
  consumer reading the request off its pipe) and "consumer" (from the
  consumer reading the request to its clock stop: the attach and the
  tensors); py_set splits "consumer" into "attach_set" (the Rust
  Subscriber.attach_set: request, record, mappings, event) and "tensors"
  (the tensors and the dict made over that attachment). Both add, from
  the extension's and the library's own clocks (_core._last_phases), each
  phase of the calls on either side as "CALL: PHASE" (py_set: the
  producer's publish_state_dict and core.publish_set, the consumer's
  attach_set, core.attach_set and attach_state_dict; py_update: the
  producer's update_set and core.update_set, the consumer's wait_update).
  Both add "gc" and "gc_full": the time Python's cycle collector ran
  inside the sample's clock, in either process (gc.callbacks), all
  collections and those of the oldest generation ("full": they visit
  every object the process holds, torch's included).
  {"kind": "error", "message": ...}
  {"kind": "done", "elapsed_s": ...}

Method (one way, CLOCK_MONOTONIC in both processes):
  py_fresh: each sample the producer takes a new buffer of its publisher's
            arena (Publisher.alloc, whose chunks were made before the first
            sample), fills it (not timed), reads the clock and publishes it
            as a set of one (Publisher.publish_set); the consumer's
            Subscriber.attach_set returns (its event waited on the host),
            it makes the torch tensor (SetAttachment.as_torch: DLPack, zero
            copy) and reads the clock; then, not timed, it checks the first
            and last value, releases and answers; the producer unpublishes.
  py_set:   COUNT fp32 tensors of TOTAL bytes (weight_set_sizes, the same
            draw as torch_share.py and the bench's Rust side), made once in
            the publisher's arena (cuda_ipc.torch.shareable). Each sample
            refills every tensor (not timed), reads the clock and calls
            Publisher.publish_state_dict (no copy: the tensors are in the
            arena); the consumer's Subscriber.attach_state_dict returns a
            dict of torch tensors (event waited) and it reads the clock; then,
            not timed, it checks the first and last value of every tensor,
            releases and answers; the producer unpublishes.
  py_update: after each py_set, the same tensors published once more and
            held by the consumer (Subscriber.attach_state_dict, checked).
            Each sample refills every tensor (not timed); the consumer says
            it is waiting and calls StateDict.wait_update; the producer reads
            the clock and calls Publisher.update_state_dict (no state dict:
            what was written into the shared tensors); the consumer's
            wait_update returns (the update's event waited for on the host)
            and it reads the clock; then, not timed, it checks the first and
            last value of every tensor and answers. parts_ms "update": the
            producer's call. With --busy-ms MS, MS of GPU work
            (torch.cuda._sleep) is queued on the producer's current stream
            just before each update (not timed), as a trainer's next step
            would be: the sample then includes it, and "update" shows
            whether the producer's call waited for it.

Usage: cuda_ipc_share.py --device 0 --plan SIZE:WARMUP:REPS[,...]
       cuda_ipc_share.py --device 0 --sets COUNT:TOTAL:WARMUP:REPS[,...] [--busy-ms MS] [--gc-freeze]
With --gc-freeze both processes call gc.freeze() once their imports and
CUDA are done, as a serving process can (the hello line says so): the
objects made so far then stay out of every later collection.
cuda_ipc and torch are imported lazily: a missing one is a skip line.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_share import awake_spin_s, emit, now_ns, parse_plan, parse_sets, weight_set_sizes  # noqa: E402

ANSWER_TIMEOUT_S = 120.0


def await_line(f, spin_s):
    """Polls the file ``f``'s descriptor for up to ``spin_s`` before the
    blocking read that follows."""
    if spin_s <= 0:
        return
    import select
    fd = f.fileno()
    end = time.perf_counter() + spin_s
    while time.perf_counter() < end:
        if select.select([fd], [], [], 0)[0]:
            return


class GcClock:
    """When Python's cycle collector ran in this process, from
    ``gc.callbacks``: ``spans``, ``(start_ns, end_ns, generation)`` of each
    collection since the last ``clear()`` (now_ns's clock)."""

    def __init__(self):
        self.spans = []
        self._began = None
        gc.callbacks.append(self._tick)

    def _tick(self, phase, info):
        t = now_ns()
        if phase == "start":
            self._began = t
        elif self._began is not None:
            self.spans.append((self._began, t, info.get("generation", -1)))
            self._began = None

    def clear(self):
        self.spans = []

    def close(self):
        gc.callbacks.remove(self._tick)


def gc_inside(spans, start_ns, end_ns):
    """``(all_ms, full_ms)``: how much of the collections ``spans``
    (``(start, end, generation)``, ns) lies between ``start_ns`` and
    ``end_ns``; full: those of generation 2."""
    all_ns = full_ns = 0
    for began, ended, generation in spans:
        inside = max(0, min(ended, end_ns) - max(began, start_ns))
        all_ns += inside
        if generation == 2:
            full_ns += inside
    return all_ns / 1e6, full_ns / 1e6


def add_gc(parts, produced, ans, start_ns):
    """Appends to ``parts`` the collections inside a kept sample's clock,
    from ``start_ns`` to the consumer's ``ans["t_ns"]``: the producer's
    (``produced``, GcClock.spans) and the consumer's (``ans["gc"]``, its
    spans through JSON)."""
    spans = list(produced) + [tuple(g) for g in ans.get("gc", [])]
    all_ms, full_ms = gc_inside(spans, start_ns, ans["t_ns"])
    parts.setdefault("gc", []).append(all_ms)
    parts.setdefault("gc_full", []).append(full_ms)


def sample_value(i, k):
    """The value of tensor k at sample i: small integers, exact in fp32."""
    return float((i * 1009 + k * 7 + 1) % 65521)


PRODUCER_CALLS = {"set": ("publish_state_dict", "core.publish_set"),
                  "update": ("update_set", "core.update_set")}
CONSUMER_CALLS = {"set": ("attach_set", "core.attach_set", "attach_state_dict"),
                  "await": ("wait_update",)}


def last_phases(calls):
    """``{"CALL: PHASE": µs}`` of the last run of each of ``calls`` on this
    thread (nothing from a wheel without the clocks)."""
    from cuda_ipc import _core

    read = getattr(_core, "_last_phases", None)
    if read is None:
        return {}
    return {"%s: %s" % (call, phase): us for call in calls for phase, us in read(call)}


def add_phases(parts, phases):
    """Appends each phase of a kept sample (µs) to ``parts`` (ms)."""
    for name, us in (phases or {}).items():
        parts.setdefault(name, []).append(us / 1e3)


def consumer_main(device, path, freeze=False):
    """Answers the producer's requests, one JSON line each, on stdout."""
    import cuda_ipc
    import torch
    from cuda_ipc import sets as _sets

    torch.cuda.set_device(device)
    sub = cuda_ipc.Subscriber(path, device=device, timeout=30)
    held = None
    if freeze:
        gc.freeze()
    collections = GcClock()
    print(json.dumps({"ready": True}), flush=True)
    spin = awake_spin_s()
    while True:
        collections.clear()
        await_line(sys.stdin, spin)
        line = sys.stdin.readline()
        if not line:
            break
        t_recv = now_ns()
        t_mid = phases = None
        req = json.loads(line)
        if req["op"] == "fresh":
            a = sub.attach_set(req["name"])
            t = a.as_torch(0)
            t_ns = now_ns()
            flat = t.reshape(-1)
            bad = int(flat[0].item()) != req["value"] or int(flat[-1].item()) != req["value"]
            del t, flat
            a.release()
        elif req["op"] == "set":
            # Subscriber.attach_state_dict in its two parts, timed apart.
            core = sub._c.attach_set(req["name"], read_only=False)
            t_mid = now_ns()
            sd = _sets.attach_state_dict(core)
            t_ns = now_ns()
            phases = last_phases(CONSUMER_CALLS["set"])
            del core
            bad = not values_match(torch, sd, req["sample"])
            sd.release()
        elif req["op"] == "hold":
            held = sub.attach_state_dict(req["name"])
            t_ns = now_ns()
            bad = not values_match(torch, held, req["sample"])
        elif req["op"] == "await":
            print(json.dumps({"waiting": True}), flush=True)
            held.wait_update(timeout=ANSWER_TIMEOUT_S)
            t_ns = now_ns()
            phases = last_phases(CONSUMER_CALLS["await"])
            bad = not values_match(torch, held, req["sample"])
        else:  # "drop"
            held.release()
            held, t_ns, bad = None, now_ns(), False
        print(json.dumps({"t_ns": t_ns, "t_recv": t_recv, "t_mid": t_mid, "phases": phases, "bad": bad,
                          "gc": collections.spans}),
              flush=True)
    sub.close()


def values_match(torch, sd, sample):
    """Whether the first and last value of every tensor of ``sd`` are those
    of ``sample`` (sample_value; tensor k in the dict's order)."""
    firsts = torch.stack([t.reshape(-1)[0] for t in sd.values()])
    lasts = torch.stack([t.reshape(-1)[-1] for t in sd.values()])
    want = torch.tensor([sample_value(sample, k) for k in range(len(sd))], device=firsts.device)
    return torch.equal(firsts, want) and torch.equal(lasts, want)


class Consumer:
    """A consumer process: ``script`` (this one by default) run with
    ``--consumer PATH --device N`` and ``args``, asked one JSON line at a
    time on its standard input, answering JSON lines on its standard
    output. ``started_ns``: the clock just before it was started."""

    def __init__(self, device, path, script=None, args=()):
        script = os.path.abspath(script or __file__)
        self.started_ns = now_ns()
        self.p = subprocess.Popen([sys.executable, "-u", script, "--consumer", path, "--device", str(device)]
                                  + list(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.spin = awake_spin_s()

    def read(self):
        await_line(self.p.stdout, self.spin)
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("the consumer exited (exit status %s)" % self.p.wait(30))
        return json.loads(line)

    def ask(self, req):
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(ANSWER_TIMEOUT_S)
        except Exception:
            self.p.kill()
            self.p.wait()
        finally:
            self.p.stdout.close()


def measure_fresh(torch, pub, consumer, size, warmup, reps, index, collections):
    samples, failures = [], 0
    parts = {"publish": [], "request": [], "consumer": []}
    n = size // 4
    for i in range(warmup + reps):
        value = (index * 1000003 + i * 7919 + 1) % (2**31 - 1)
        buf = pub.alloc(size)
        buf.as_torch("i32", [n]).fill_(value)
        torch.cuda.synchronize()
        name = "fresh-%d-%d" % (index, i)
        collections.clear()
        t0 = now_ns()
        pub.publish_set(name, [(name, buf, "i32", [n])])
        t_pub = now_ns()
        ans = consumer.ask({"op": "fresh", "name": name, "value": value})
        pub.unpublish_set(name, timeout=ANSWER_TIMEOUT_S)
        del buf
        failures += bool(ans["bad"]) and i >= warmup
        if i >= warmup:
            samples.append((ans["t_ns"] - t0) / 1e6)
            keep_parts(parts, t0, t_pub, ans, collections.spans)
    return samples, failures, parts


def keep_parts(parts, t0, t_pub, ans, produced_gc):
    """The producer's call and the consumer's work of one sample, ms;
    ``produced_gc``: the producer's collections (GcClock.spans) since just
    before ``t0``."""
    parts["publish"].append((t_pub - t0) / 1e6)
    parts["request"].append((ans["t_recv"] - t_pub) / 1e6)
    parts["consumer"].append((ans["t_ns"] - ans["t_recv"]) / 1e6)
    if ans.get("t_mid") is not None:
        parts.setdefault("attach_set", []).append((ans["t_mid"] - ans["t_recv"]) / 1e6)
        parts.setdefault("tensors", []).append((ans["t_ns"] - ans["t_mid"]) / 1e6)
    add_phases(parts, ans.get("phases"))
    add_gc(parts, produced_gc, ans, t0)


def fill(torch, tensors, sample):
    """Every tensor k of ``tensors`` filled with sample_value(sample, k), finished."""
    for k, t in enumerate(tensors.values()):
        t.fill_(sample_value(sample, k))
    torch.cuda.synchronize()


def measure_set(torch, ci, pub, consumer, count, total, warmup, reps, index, collections, busy_cycles=0):
    """The py_set samples and then the py_update samples of one weight set:
    ``((samples, failures, parts), (samples, failures, parts))``."""
    sizes = weight_set_sizes(count, total)
    with ci.torch.shareable(pub):
        tensors = {"w%d" % k: torch.empty(s // 4, dtype=torch.float32, device="cuda") for k, s in enumerate(sizes)}
    try:
        return (measure_handoff(torch, pub, consumer, tensors, warmup, reps, index, collections),
                measure_update(torch, pub, consumer, tensors, warmup, reps, index, collections, busy_cycles))
    finally:
        del tensors
        ci.torch.empty_cache(pub)


def measure_handoff(torch, pub, consumer, tensors, warmup, reps, index, collections):
    samples, failures = [], 0
    parts = {"publish": [], "request": [], "consumer": [], "attach_set": [], "tensors": []}
    for i in range(warmup + reps):
        fill(torch, tensors, i)
        name = "set-%d-%d" % (index, i)
        collections.clear()
        t0 = now_ns()
        pub.publish_state_dict(name, tensors)
        t_pub = now_ns()
        ans = consumer.ask({"op": "set", "name": name, "sample": i})
        # Read once the consumer has answered: before the request, this
        # would run inside the sample's clock. No call of ours ran on this
        # thread in between.
        produced = last_phases(PRODUCER_CALLS["set"])
        pub.unpublish(name, timeout=ANSWER_TIMEOUT_S)
        failures += bool(ans["bad"]) and i >= warmup
        if i >= warmup:
            samples.append((ans["t_ns"] - t0) / 1e6)
            keep_parts(parts, t0, t_pub, ans, collections.spans)
            add_phases(parts, produced)
    return samples, failures, parts


def measure_update(torch, pub, consumer, tensors, warmup, reps, index, collections, busy_cycles=0):
    """Samples of update_state_dict -> wait_update of a state dict the
    consumer holds (sample 0 published, then samples 1..); with
    ``busy_cycles``, that much GPU work (torch.cuda._sleep) queued on the
    current stream just before each update, as a trainer's next step."""
    samples, failures = [], 0
    parts = {"update": []}
    name = "held-%d" % index
    fill(torch, tensors, 0)
    pub.publish_state_dict(name, tensors)
    try:
        ans = consumer.ask({"op": "hold", "name": name, "sample": 0})
        if ans["bad"]:
            raise RuntimeError("the held state dict %s does not have the values published" % name)
        for i in range(1, warmup + reps + 1):
            fill(torch, tensors, i)
            consumer.ask({"op": "await", "sample": i})
            if busy_cycles:
                torch.cuda._sleep(busy_cycles)
            collections.clear()
            t0 = now_ns()
            pub.update_state_dict(name)
            t_upd = now_ns()
            produced = last_phases(PRODUCER_CALLS["update"])
            ans = consumer.read()
            if i > warmup:
                failures += bool(ans["bad"])
                samples.append((ans["t_ns"] - t0) / 1e6)
                parts["update"].append((t_upd - t0) / 1e6)
                add_phases(parts, produced)
                add_phases(parts, ans.get("phases"))
                add_gc(parts, collections.spans, ans, t0)
        consumer.ask({"op": "drop"})
    finally:
        pub.unpublish(name, timeout=ANSWER_TIMEOUT_S)
    return samples, failures, parts


def import_on_device(device):
    """cuda_ipc and torch, imported, with CUDA device `device` made
    current; or None after emitting the skip record that says which is
    missing (the caller then exits 0)."""
    try:
        import cuda_ipc
    except ImportError as e:
        emit({"kind": "skip", "reason": "cuda_ipc is not importable (%s); pip install the wheel" % e})
        return None
    try:
        import torch
    except ImportError as e:
        emit({"kind": "skip", "reason": "torch is not importable (%s)" % e})
        return None
    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        emit({"kind": "skip", "reason": "PyTorch sees no CUDA device %d" % device})
        return None
    torch.cuda.set_device(device)
    return cuda_ipc, torch


def busy_ms_to_cycles(torch, device, ms):
    """GPU clock cycles (torch.cuda._sleep's unit) in ``ms`` milliseconds
    on ``device``: its clock rate where PyTorch gives it, else 1.98 GHz."""
    if ms <= 0:
        return 0
    khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 1_980_000
    return int(ms * khz)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--plan", help="SIZE:WARMUP:REPS,... (py_fresh)")
    ap.add_argument("--sets", help="COUNT:TOTAL:WARMUP:REPS,... (py_set, then py_update)")
    ap.add_argument("--busy-ms", type=float, default=0.0,
                    help="GPU work queued on the producer's stream before each update, in ms (py_update; "
                         "its 'update' part then shows whether the producer's call waits for it)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() in both processes once their imports and CUDA are done")
    ap.add_argument("--consumer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.consumer:
        return consumer_main(args.device, args.consumer, args.gc_freeze)
    try:
        plan = parse_plan(args.plan) if args.plan else []
        sets = parse_sets(args.sets) if args.sets else []
    except ValueError as e:
        emit({"kind": "error", "message": str(e)})
        return 2
    started = time.time()
    imported = import_on_device(args.device)
    if imported is None:
        return 0
    cuda_ipc, torch = imported
    emit({"kind": "hello", "cuda_ipc": cuda_ipc.__version__, "torch": torch.__version__,
          "device": torch.cuda.get_device_name(args.device), "python": sys.version.split()[0],
          "gc_freeze": args.gc_freeze})
    path = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-bench-py-"), "p.sock")
    pub = cuda_ipc.Publisher(path, device=args.device)
    if args.gc_freeze:
        torch.empty(1, device="cuda").sum().item()  # CUDA's start, as the consumer's
        gc.freeze()
    collections = GcClock()
    t0 = time.perf_counter()
    consumer = Consumer(args.device, path, args=["--gc-freeze"] if args.gc_freeze else ())
    try:
        consumer.read()
        emit({"kind": "startup", "consumer_ms": (time.perf_counter() - t0) * 1e3})
        for index, (size, warmup, reps) in enumerate(plan):
            samples, failures, parts = measure_fresh(torch, pub, consumer, size, warmup, reps, index, collections)
            emit({"kind": "result", "mode": "py_fresh", "size": size, "warmup": warmup,
                  "samples_ms": samples, "verify_failures": failures, "parts_ms": parts})
        busy_cycles = busy_ms_to_cycles(torch, args.device, args.busy_ms)
        for index, (count, total, warmup, reps) in enumerate(sets):
            measured = measure_set(torch, cuda_ipc, pub, consumer, count, total, warmup, reps, index, collections,
                                   busy_cycles)
            for mode, (samples, failures, parts) in zip(("py_set", "py_update"), measured):
                emit({"kind": "result", "mode": mode, "size": total, "count": count, "warmup": warmup,
                      "samples_ms": samples, "verify_failures": failures, "parts_ms": parts,
                      **({"busy_ms": args.busy_ms} if mode == "py_update" and busy_cycles else {})})
    except Exception as e:
        emit({"kind": "error", "message": "%s: %s" % (type(e).__name__, e)})
        traceback.print_exc()
        return 1
    finally:
        consumer.close()
        pub.close()
    emit({"kind": "done", "elapsed_s": time.time() - started})
    return 0


if __name__ == "__main__":
    sys.exit(main())
