"""Chaos run of the weight service (issue 26): writers and readers killed
at random points while the service (``cuda-ipc serve --service``) keeps
one set. The service must stay up, readers must always see one complete
committed version (checked by content: every tensor of version v holds
v), and once every client is gone the service's device memory and open
descriptors must come back to their starting values.

    python3 gpu_service_chaos.py --cli PATH_TO_cuda-ipc [--rounds N] [--seed S]

Writers and readers are this script in a role (``--worker``), driven by
JSON lines. A round picks one of: a writer that writes a whole version
and commits (or aborts), one killed (SIGKILL) before its open is
answered, in the middle of its write, while its commit is on the way or
after its commit; a second writer refused while one holds the set; a
reader that attaches (read-only), checks and holds the version a while,
or is killed while attached or while attaching; a reader's check of what
it holds; a release; ``drop``, ``ls`` or ``stats``. At the end every
worker is killed, a new reader checks the set, the set is dropped, and
``stats`` (device memory, bytes held, leases) and /proc/PID/fd of the
service must be what they were after a warm-up, within a settle deadline.

Needs a CUDA GPU, torch and the cuda_ipc package; exits 77 with one line
when one is missing. Prints one line per check and "N passed, M failed"
last. Passed on an H200 on 2026-12-01 (200 rounds; docs/SERVICE.md).
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

SET = "chaos"
TENSORS = 4
SHAPE = (256, 1024)  # 1 MiB of fp32 each


# --- workers ------------------------------------------------------------------


class Worker:
    """This script as a worker: `call` sends one JSON request and reads one
    answer; `send` only sends (the caller kills it at a random point)."""

    def __init__(self, role):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.role = role
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def send(self, op, **args):
        self.p.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.p.stdin.flush()

    def call(self, op, **args):
        self.send(op, **args)
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(f"{self.role} worker {self.p.pid} died during {op} (exit {self.p.wait()})")
        r = json.loads(line)
        if "error" in r:
            raise AssertionError(f"{self.role} {op}: {r['error']}")
        return r

    def kill(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
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
    import torch

    from cuda_ipc import errors, service

    st = {}
    layout = {f"w{i}": ("f32", SHAPE) for i in range(TENSORS)}

    def values(sd):
        """The distinct values of every tensor, and how many tensors."""
        seen = set()
        for t in sd.values():
            seen.add(float(t.min()))
            seen.add(float(t.max()))
        return {"values": sorted(seen), "tensors": len(sd)}

    def open_write(sock, wait_s):
        """Opens a write of the set (creating it when it is gone); a set
        held by another writer is waited for up to `wait_s`."""
        deadline = time.monotonic() + wait_s
        create = False
        while True:
            w = service.Writer(sock, SET, layout=layout if create else None)
            try:
                w.open()
                st["w"] = w
                return {"version": w.version, "creates": w.opened["creates"]}
            except errors.ServiceError as e:
                w.close()
                if e.code == "not_found" and not create:
                    create = True
                    continue
                if e.code == "exists" and create:
                    create = False
                    continue
                if e.code == "writing" and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                return {"refused": e.code, "message": str(e)}

    def fill(slow=False):
        """Writes the version's number into every element, tensor by
        tensor (slowly: a pause after each, for kills in the middle)."""
        w = st["w"]
        for t in w.state_dict.values():
            t.fill_(float(w.version))
            if slow:
                torch.cuda.synchronize()
                time.sleep(0.01)
        torch.cuda.synchronize()
        return {"version": w.version}

    def commit():
        # The connection stays open (a kill after the commit finds it so).
        st["done"] = st.pop("w")
        return st["done"].commit()

    def abort():
        st["done"] = st.pop("w")
        return st["done"].abort()

    def attach(sock):
        r = service.Reader(sock)
        try:
            sd = r.attach_state_dict(SET)
        except errors.ServiceError as e:
            r.close()
            return {"refused": e.code, "message": str(e)}
        except errors.CudaIpcError as e:
            r.close()
            return {"refused": type(e).__name__, "message": str(e)}
        st["r"], st["sd"] = r, sd
        return values(sd) | {"read_only": bool(sd.read_only)}

    def check():
        return values(st["sd"])

    def release():
        st.pop("sd").release()
        st.pop("r").close()
        return {"ok": True}

    ops = {"open_write": open_write, "fill": fill, "commit": commit, "abort": abort,
           "attach": attach, "check": check, "release": release}
    torch.cuda.init()
    for line in sys.stdin:
        req = json.loads(line)
        name = req.pop("op")
        try:
            r = ops[name](**req)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            r = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(r) + "\n")
        sys.stdout.flush()


# --- the run ------------------------------------------------------------------


class Chaos:
    def __init__(self, sock, service_proc, rng):
        from cuda_ipc import service

        self.svc = service
        self.sock = sock
        self.proc = service_proc
        self.rng = rng
        self.committed = set()  # versions whose commit was sent (maybe done)
        self.confirmed = 0  # the newest version whose commit was answered
        self.exists = True  # False after a drop until a commit is answered; None: unknown
        self.readers = [None, None, None]  # (Worker, value held or None)
        self.writers = []  # spare writer workers, started ahead (torch takes seconds)
        self.counts = {}

    def count(self, what):
        self.counts[what] = self.counts.get(what, 0) + 1

    def alive(self):
        code = self.proc.poll()
        assert code is None, f"the service exited ({code})"

    def writer(self):
        while len(self.writers) < 2:
            self.writers.append(Worker("writer"))
        return self.writers.pop(0)

    def reader_at(self, i):
        if self.readers[i] is None:
            self.readers[i] = (Worker("reader"), None)
        return self.readers[i][0]

    def check_values(self, r, at_least, what):
        """`r` (an attach's answer) holds one committed version, complete."""
        assert "refused" not in r, f"{what}: refused: {r}"
        vals = r["values"]
        assert r["tensors"] == TENSORS, f"{what}: {r['tensors']} tensors, not {TENSORS}"
        assert len(vals) == 1, f"{what}: tensors hold several values {vals[:8]}: a version seen incomplete"
        v = int(vals[0])
        assert vals[0] == v and v in self.committed, \
            f"{what}: value {vals[0]} is no version whose commit was sent ({sorted(self.committed)[-5:]})"
        assert v >= at_least, f"{what}: version {v} is older than {at_least}, committed before the attach"
        return v

    # Writers.
    def write(self, how):
        w = self.writer()
        if how == "kill_before_open":
            w.send("open_write", sock=self.sock, wait_s=5.0)
            time.sleep(self.rng.uniform(0, 0.05))
            w.kill()
            return
        r = w.call("open_write", sock=self.sock, wait_s=10.0)
        assert "refused" not in r, f"open_write refused with no writer alive: {r}"
        v = r["version"]
        assert v > self.confirmed, f"open_write gave version {v}, not above {self.confirmed}"
        if how == "kill_mid_write":
            w.send("fill", slow=True)
            time.sleep(self.rng.uniform(0, 0.05))
            w.kill()
            return
        if how == "conflict":
            other = self.writer()
            r2 = other.call("open_write", sock=self.sock, wait_s=0.0)
            assert r2.get("refused") == "writing", f"a second writer was not refused 'writing': {r2}"
            other.stop()
        w.call("fill")
        if how == "abort":
            w.call("abort")
            w.stop()
            return
        self.committed.add(v)
        if how == "kill_during_commit":
            w.send("commit")
            time.sleep(self.rng.uniform(0, 0.02))
            w.kill()
            self.exists = True if self.exists else None
            return
        r = w.call("commit")
        assert r["version"] == v, f"commit answered {r}, opened {v}"
        self.confirmed, self.exists = v, True
        if how == "kill_after_commit":
            w.kill()
        else:
            w.stop()

    # Readers.
    def attach(self, i, how):
        w = self.reader_at(i)
        if self.readers[i][1] is not None:
            w.call("release")
        if how == "kill_while_attaching":
            w.send("attach", sock=self.sock)
            time.sleep(self.rng.uniform(0, 0.05))
            w.kill()
            self.readers[i] = None
            return
        at_least = self.confirmed
        r = w.call("attach", sock=self.sock)
        if "refused" in r:
            assert self.exists is not True, f"reader {i} was refused a set that exists: {r}"
            self.readers[i] = (w, None)
            return
        assert r["read_only"], "a reader's tensors are not read-only"
        v = self.check_values(r, at_least, f"reader {i} attaching")
        self.readers[i] = (w, v)
        time.sleep(self.rng.uniform(0, 0.05))  # holds it a while

    def recheck(self, i):
        if self.readers[i] is None or self.readers[i][1] is None:
            return
        w, v = self.readers[i]
        r = w.call("check")
        assert r["values"] == [float(v)], f"reader {i} held version {v} and now reads {r['values'][:8]}"

    def round(self):
        from cuda_ipc.errors import CudaIpcError

        rng = self.rng
        action = rng.choice(["write", "write", "write", "attach", "attach", "recheck", "release",
                             "kill_reader", "drop", "ls", "stats"])
        i = rng.randrange(len(self.readers))
        if action == "write":
            how = rng.choice(["commit", "commit", "abort", "conflict", "kill_before_open",
                              "kill_mid_write", "kill_during_commit", "kill_after_commit"])
            self.write(how)
            action += " " + how
        elif action == "attach":
            how = rng.choice(["hold", "hold", "kill_while_attaching"])
            self.attach(i, how)
            action += " " + how
        elif action == "recheck":
            self.recheck(i)
        elif action == "release":
            if self.readers[i] is not None and self.readers[i][1] is not None:
                self.readers[i][0].call("release")
                self.readers[i] = (self.readers[i][0], None)
        elif action == "kill_reader":
            if self.readers[i] is not None:
                self.readers[i][0].kill()
                self.readers[i] = None
        elif action == "drop":
            try:
                self.svc.drop(self.sock, SET)
                self.exists = False
                action += " done"
            except CudaIpcError as e:
                code = getattr(e, "code", None)
                allowed = ("leased", "writing") if self.exists is True else ("leased", "writing", "not_found")
                assert code in allowed, f"drop refused with {code} (the set exists: {self.exists}): {e}"
                action += " " + str(code)
        elif action == "ls":
            rows = [s for s in self.svc.ls(self.sock) if s["name"] == SET]
            for s in rows:
                if s["state"] == "committed":
                    assert s["version"] >= self.confirmed or self.exists is not True, \
                        f"ls shows version {s['version']}, older than {self.confirmed}"
        elif action == "stats":
            s = self.svc.stats(self.sock)
            assert not s["stopping"], s
        self.count(action)
        for j in range(len(self.readers)):
            self.recheck(j)
        self.alive()

    def everyone_gone(self):
        for r in self.readers:
            if r is not None:
                r[0].kill()
        for w in self.writers:
            w.kill()
        self.readers = [None] * len(self.readers)
        self.writers = []


def fds_of(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def settle(probe, good, deadline_s=30.0):
    """Polls `probe` until `good(value)` or the deadline passes; returns the
    last value."""
    end = time.monotonic() + deadline_s
    got = probe()
    while not good(got) and time.monotonic() < end:
        time.sleep(0.2)
        got = probe()
    return got


def usage(svc, sock):
    s = svc.stats(sock)
    return {"total_bytes": s["total_bytes"], "leases": s["leases"], "sets": s["sets"],
            "used": sum(u["used"] + u["reserved"] for u in s["uids"]), "device_free": s["device_free"]}


def run(cli, rounds, seed, mem_slack_mib, report):
    from cuda_ipc import service as svc

    folder = tempfile.mkdtemp(prefix="cuda-ipc-service-chaos-")
    sock = os.path.join(folder, "svc.sock")
    proc = subprocess.Popen([cli, "serve", "--service", sock, "--grace", "5s"], stdout=subprocess.PIPE,
                            stderr=open(os.path.join(folder, "serve.err"), "w"), text=True)
    first = proc.stdout.readline()
    if not first:
        raise AssertionError(f"serve --service printed nothing (exit {proc.wait()}); see {folder}/serve.err")
    pid = json.loads(first)["pid"]
    rng = random.Random(seed)
    chaos = Chaos(sock, proc, rng)
    try:
        # Warm-up: a version written and read, then dropped; the service's
        # context and the arena's first chunks have been made once.
        chaos.write("commit")
        chaos.attach(0, "hold")
        # No client process (and no CUDA context of one) while counting.
        chaos.everyone_gone()
        settle(lambda: svc.stats(sock)["leases"], lambda n: n == 0)
        svc.drop(sock, SET)
        chaos.exists = False
        time.sleep(1.0)
        start = usage(svc, sock)
        time.sleep(0.5)  # the stats call's connection closes in the service
        start_fds = fds_of(pid)
        report(True, "warm-up", f"service pid {pid}: {start_fds} descriptors, {start['device_free']} bytes free")
        chaos.write("commit")
        t = time.monotonic()
        for n in range(rounds):
            chaos.round()
            if (n + 1) % 50 == 0:
                print(f"round {n + 1}: {json.dumps(chaos.counts, sort_keys=True)}", flush=True)
        report(True, "rounds", f"{rounds} rounds in {time.monotonic() - t:.1f} s, the service up throughout: "
               f"{json.dumps(chaos.counts, sort_keys=True)}")

        chaos.everyone_gone()
        got = settle(lambda: [(s["state"], len(s["leases"])) for s in svc.ls(sock)
                              if s["name"] == SET and (s["state"] != "committed" or s["leases"])],
                     lambda rows: rows == [])
        report(got == [], "clients gone", "no writer and no lease left" if got == [] else f"still {got}")
        if chaos.exists is not True:
            chaos.write("commit")  # the set was dropped last, or a killed commit left it unknown
        reader = Worker("reader")
        at_least = chaos.confirmed
        r = reader.call("attach", sock=sock)
        v = chaos.check_values(r, at_least, "a new reader at the end")
        reader.call("release")
        reader.stop()
        rows = [s for s in svc.ls(sock) if s["name"] == SET]
        report(len(rows) == 1 and rows[0]["version"] == v and rows[0]["state"] == "committed",
               "the set at the end", f"version {v} complete (every tensor holds {v}); ls: {rows}")
        settle(lambda: svc.stats(sock)["leases"], lambda n: n == 0)
        svc.drop(sock, SET)
        chaos.everyone_gone()
        slack = mem_slack_mib << 20

        def back(u):
            same = {k: v for k, v in u.items() if k != "device_free"} == \
                {k: v for k, v in start.items() if k != "device_free"}
            return same and u["device_free"] is not None and abs(u["device_free"] - start["device_free"]) <= slack

        end = settle(lambda: usage(svc, sock), back)
        report(back(end), "device memory back",
               f"start {start}, end {end} (free memory may differ by {mem_slack_mib} MiB)")
        end_fds = settle(lambda: fds_of(pid), lambda n: n == start_fds)
        report(end_fds == start_fds, "descriptors back", f"{start_fds} at the start, {end_fds} at the end")
    finally:
        chaos.everyone_gone()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "killed after 60 s"
    report(code == 0, "SIGTERM", f"the service exited {code}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cli", help="path to the cuda-ipc command")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock, printed)")
    ap.add_argument("--mem-slack-mib", type=int, default=0,
                    help="how far the device's free memory may end from its start (default 0: exactly)")
    args = ap.parse_args()
    if args.worker:
        return worker_main()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_interop import EXIT_SKIPPED, missing_requirement

    missing = missing_requirement()
    if missing:
        print(f"gpu_service_chaos: skipped: {missing}", flush=True)
        return EXIT_SKIPPED
    if not args.cli or not os.access(args.cli, os.X_OK):
        ap.error("--cli must name the cuda-ipc command")
    seed = args.seed if args.seed is not None else int(time.time())
    print(f"seed {seed}", flush=True)
    counts = [0, 0]

    def report(ok, name, what):
        counts[0 if ok else 1] += 1
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {what}", flush=True)

    try:
        run(args.cli, args.rounds, seed, args.mem_slack_mib, report)
    except Exception as e:  # noqa: BLE001 - the run reports
        report(False, "chaos", f"{type(e).__name__}: {e}")
    print(f"{counts[0]} passed, {counts[1]} failed")
    return 1 if counts[1] else 0


if __name__ == "__main__":
    sys.exit(main())
