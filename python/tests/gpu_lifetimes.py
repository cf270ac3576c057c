"""GPU checks of lifetimes from Python, where users break them: a kept
tensor keeps its lease after its state dict and Subscriber are gone; a
mapping closed under a CUDA-array-interface consumer stays mapped; a
consumed DLPack capsule never erases an exception in flight; freeing a
tensor while the publisher is stopped (SIGSTOP) does not hang; and a chaos
run of consumers that drop, keep and die while the publisher updates,
unpublishes and publishes again.

    python3 gpu_lifetimes.py [--rounds N] [--only NAME]

Each case runs in fresh worker processes (this script in a role). Needs a
CUDA GPU, torch and the cuda_ipc package; exits 77 with one sentence when
one is missing. Prints one line per case and "N passed, M failed" last.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

NAME = "m"
SHAPE = (256, 1024)  # 1 MiB of fp32 per tensor


def _sd(torch, n, value):
    return {f"w{i}": torch.full(SHAPE, float(value), device="cuda") for i in range(n)}


# --- workers ------------------------------------------------------------------


class Worker:
    """This script run as a worker; `call` sends one JSON request and reads
    one JSON answer."""

    def __init__(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)

    def call(self, op, **args):
        self.p.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(f"worker {self.p.pid} died during {op} (exit {self.p.wait()})")
        r = json.loads(line)
        if "error" in r:
            raise AssertionError(f"{op}: {r['error']}")
        return r

    def kill(self):
        self.p.kill()
        self.p.wait()

    def stop(self):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


def worker_main():
    import gc

    import torch

    import cuda_ipc

    st = {}

    def mem():
        cuda_ipc.settle(10)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]

    def fds():
        cuda_ipc.settle(10)
        return len(os.listdir("/proc/self/fd"))

    ops = {}

    def op(f):
        ops[f.__name__] = f
        return f

    @op
    def publish(path, n, value, name=NAME):
        if "pub" not in st:
            st["pub"] = cuda_ipc.Publisher(path)
        st.setdefault("shared", {})[name] = st["pub"].publish_state_dict(name, _sd(torch, n, value))
        torch.cuda.synchronize()
        return {"pid": os.getpid()}

    @op
    def update(value, name=NAME):
        v = st["pub"].update_state_dict(name, _sd(torch, len(st["shared"][name]), value))
        torch.cuda.synchronize()
        return {"version": v}

    @op
    def unpublish(name=NAME, timeout=10.0):
        t = time.perf_counter()
        try:
            st["pub"].unpublish(name, timeout=timeout)
            ok = True
        except cuda_ipc.CudaIpcError:
            ok = False
        st["shared"].pop(name, None)
        return {"ok": ok, "ms": (time.perf_counter() - t) * 1e3}

    @op
    def leases(name=NAME):
        return {"n": sum(1 for l in st["pub"].leases() if l["name"] == name)}

    @op
    def reap():
        st["pub"].reap()
        return {"retired": st["pub"].retired_sets()}

    @op
    def usage():
        # The arena keeps idle chunks for reuse: give them back first, so
        # that what is counted is what something still holds.
        trimmed = st["pub"].trim()
        return {"mem": mem(), "fds": fds(), "trimmed": trimmed, "arena": st["pub"].arena_stats()}

    @op
    def attach(path, keep, name=NAME):
        """Attaches `name`; keep "dict" (the state dict and subscriber),
        "tensor" (one tensor: dict and subscriber dropped), "none"."""
        sub = cuda_ipc.Subscriber(path)
        sd = sub.attach_state_dict(name)
        values = {float(t[0, 0]) for t in sd.values()}
        st.pop("sd", None), st.pop("sub", None), st.pop("t", None)
        if keep == "dict":
            st["sd"], st["sub"] = sd, sub
        elif keep == "tensor":
            st["t"] = sd["w0"]
            del sd
            sub.close()
            del sub
        else:
            sd.release()
            sub.close()
            del sd, sub
        gc.collect()
        return {"values": sorted(values)}

    @op
    def check(want):
        """Every value this worker holds is `want`."""
        held = []
        if "t" in st:
            held.append(st["t"])
        if "sd" in st:
            held.extend(st["sd"].values())
        bad = sum(int((t != want).sum()) for t in held)
        return {"held": len(held), "bad": bad}

    @op
    def wait_update(timeout=10.0):
        return {"version": st["sd"].wait_update(timeout)}

    @op
    def drop():
        t0 = time.perf_counter()
        for k in ("t", "sd", "sub"):
            v = st.pop(k, None)
            if k == "sub" and v is not None:
                v.close()
            del v
        ms = (time.perf_counter() - t0) * 1e3
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return {"ms": ms}

    @op
    def settle():
        return {"settled": cuda_ipc.settle(10)}

    @op
    def export(value):
        t = torch.full((1 << 20,), float(value), device="cuda")
        e = cuda_ipc.export_torch(t)
        st["export"] = (t, e)
        torch.cuda.synchronize()
        return {"descriptor": e.descriptor}

    @op
    def cai_close(descriptor, want):
        """Hole 4: a tensor made through __cuda_array_interface__, then
        close(): the memory stays mapped while the tensor lives."""
        m = cuda_ipc.open(descriptor)
        t = torch.as_tensor(m, device="cuda")
        m.close()
        gc.collect()
        cuda_ipc.settle(10)
        live = cuda_ipc.live_mappings()
        bad = int((t != want).sum())
        torch.cuda.synchronize()
        del t, m
        gc.collect()
        return {"live_after_close": live, "bad": bad, "settled": cuda_ipc.settle(10),
                "live_at_end": cuda_ipc.live_mappings()}

    @op
    def dlpack_exception(descriptor):
        """Hole 5: a consumed capsule collected while an exception
        propagates keeps the exception."""
        m = cuda_ipc.open(descriptor)

        def fails():
            cap = m.__dlpack__()
            t = torch.from_dlpack(cap)
            del t
            raise ValueError("in flight")

        try:
            fails()
        except ValueError as e:
            what = f"ValueError: {e}"
        except BaseException as e:  # noqa: BLE001 - the bug shows as SystemError
            what = f"{type(e).__name__}: {e}"
        m.close()
        return {"raised": what}

    for line in sys.stdin:
        req = json.loads(line)
        name = req.pop("op")
        try:
            r = ops[name](**req)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            r = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(r) + "\n")
        sys.stdout.flush()


# --- cases --------------------------------------------------------------------


def case_kept_tensor(path):
    pub, con = Worker(), Worker()
    try:
        pub.call("publish", path=path, n=4, value=7)
        r = con.call("attach", path=path, keep="tensor")
        assert r["values"] == [7.0], r
        assert pub.call("leases")["n"] == 1, "the kept tensor lost its lease"
        r = pub.call("unpublish", timeout=2.0)
        assert not r["ok"] and r["ms"] >= 1900, f"unpublish returned under a kept tensor: {r}"
        pub.call("publish", path=path, n=8, value=9, name="m2")
        r = con.call("check", want=7.0)
        assert r["held"] == 1 and r["bad"] == 0, f"the kept tensor changed: {r}"
        con.call("drop")
        deadline = time.time() + 10
        while pub.call("leases")["n"] and time.time() < deadline:
            time.sleep(0.02)
        assert pub.call("leases")["n"] == 0, "the lease outlived the tensor"
        return "unpublish waited for the kept tensor; its values never changed"
    finally:
        pub.stop()
        con.stop()


def case_cai_close(path):
    prod, con = Worker(), Worker()
    try:
        d = prod.call("export", value=5)["descriptor"]
        r = con.call("cai_close", descriptor=d, want=5.0)
        assert r["live_after_close"] == 1 and r["bad"] == 0, f"close() unmapped under the tensor: {r}"
        assert r["settled"] and r["live_at_end"] == 0, f"the mapping outlived its last user: {r}"
        return "close() left the memory to the CAI tensor"
    finally:
        prod.stop()
        con.stop()


def case_dlpack_exception(path):
    prod, con = Worker(), Worker()
    try:
        d = prod.call("export", value=1)["descriptor"]
        r = con.call("dlpack_exception", descriptor=d)
        assert r["raised"] == "ValueError: in flight", f"the exception was lost: {r}"
        return "the exception survived the consumed capsule"
    finally:
        prod.stop()
        con.stop()


def case_sigstop(path):
    pub, con = Worker(), Worker()
    try:
        pid = pub.call("publish", path=path, n=16, value=3)["pid"]
        con.call("attach", path=path, keep="dict")
        os.kill(pid, signal.SIGSTOP)
        try:
            r = con.call("drop")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert r["ms"] < 100, f"freeing tensors while the publisher was stopped took {r['ms']:.1f} ms"
        assert con.call("settle")["settled"]
        return f"freed in {r['ms']:.2f} ms while the publisher was stopped"
    finally:
        pub.stop()
        con.stop()


def case_chaos(path, rounds, seed=1):
    """Consumers keep tensors or dicts, drop them, or are killed, while the
    publisher updates, unpublishes and publishes new sets. Each live
    consumer reads only the values it was given; memory and descriptors
    come back."""
    rng = random.Random(seed)
    pub = Worker()
    cons = [Worker() for _ in range(3)]
    value = 1
    try:
        pub.call("publish", path=path, n=4, value=value)
        # Every consumer process has its CUDA context and the kernels its
        # checks load (lazily, on first use) before each count.
        def warm_all():
            for c in cons:
                c.call("attach", path=path, keep="dict")
                c.call("check", want=float(value))
                c.call("drop")
        warm_all()
        start = pub.call("usage")
        held = [None] * len(cons)  # the value each consumer holds, or None
        kills = updates = republished = 0
        for _ in range(rounds):
            i = rng.randrange(len(cons))
            action = rng.choice(["attach_tensor", "attach_dict", "drop", "check", "kill",
                                 "update", "republish"])
            if action in ("attach_tensor", "attach_dict"):
                r = cons[i].call("attach", path=path, keep=action.split("_")[1])
                assert r["values"] == [float(value)], r
                held[i] = value
            elif action == "drop":
                cons[i].call("drop")
                held[i] = None
            elif action == "kill":
                cons[i].kill()
                cons[i] = Worker()
                held[i] = None
                kills += 1
            elif action == "update":
                # Updates write in place: only when nobody keeps a lone
                # tensor of an older version (dict holders follow updates).
                if any(h is not None for h in held):
                    continue
                value += 1
                pub.call("update", value=value)
                updates += 1
            elif action == "republish":
                r = pub.call("unpublish", timeout=0.2)
                if not r["ok"]:
                    # Kept tensors hold the old set: it stays, hidden.
                    assert any(h is not None for h in held), f"unpublish timed out with no holder: {r}"
                value += 1
                pub.call("publish", path=path, n=4, value=value)
                republished += 1
            for j, c in enumerate(cons):
                if held[j] is not None:
                    r = c.call("check", want=float(held[j]))
                    assert r["bad"] == 0, f"consumer {j} holding version {held[j]} read other values: {r}"
        for c in cons:
            c.call("drop")
            c.call("settle")
        pub.call("unpublish", timeout=10)
        deadline = time.time() + 10
        while pub.call("reap")["retired"] and time.time() < deadline:
            time.sleep(0.05)
        pub.call("publish", path=path, n=4, value=value)
        warm_all()
        end = pub.call("usage")
        assert end["fds"] == start["fds"], f"descriptors {start['fds']} -> {end['fds']}"
        assert end["mem"] == start["mem"], (f"free memory {start['mem']} -> {end['mem']}; "
                                            f"arena {start['arena']} -> {end['arena']}")
        return (f"{rounds} rounds: {kills} kills, {updates} updates, {republished} republished; "
                f"memory and descriptors back to the start")
    finally:
        pub.stop()
        for c in cons:
            c.stop()


CASES = {
    "kept_tensor": case_kept_tensor,
    "cai_close": case_cai_close,
    "dlpack_exception": case_dlpack_exception,
    "sigstop": case_sigstop,
    "chaos": None,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--only")
    args = ap.parse_args()
    if args.worker:
        return worker_main()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_interop import EXIT_SKIPPED, missing_requirement

    missing = missing_requirement()
    if missing:
        print(f"gpu_lifetimes: skipped: {missing}", flush=True)
        return EXIT_SKIPPED
    passed = failed = 0
    for name in CASES:
        if args.only and name != args.only:
            continue
        folder = tempfile.mkdtemp(prefix="cuda-ipc-lifetimes-")
        path = os.path.join(folder, "p.sock")
        t = time.perf_counter()
        try:
            what = case_chaos(path, args.rounds) if name == "chaos" else CASES[name](path)
            passed += 1
            print(f"PASS  {name}: {what} ({time.perf_counter() - t:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - every case reports
            failed += 1
            print(f"FAIL  {name}: {e}", flush=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
