"""gpu_service_chaos.py's rounds without a GPU: its Chaos driver against an
in-process stand-in of the service and its workers (a version committed
or not, leases, one writer, refusals with their codes, workers killed
before or after a request arrives), so that a mistake in the driver shows
here rather than on the GPU host. What the service does is not checked
here."""

import os
import random
import sys
import time
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402,F401

import gpu_service_chaos as chaos  # noqa: E402
from cuda_ipc.errors import CudaIpcError  # noqa: E402


class Refused(CudaIpcError):
    def __init__(self, code):
        super().__init__(code)
        self.code = code


class StandIn:
    """The service's books: the current version, the writer, leases."""

    def __init__(self):
        self.versions = 0
        self.current = None
        self.writer = None
        self.leases = {}

    def drop(self, sock, name):
        if self.current is None:
            raise Refused("not_found")
        if self.writer is not None:
            raise Refused("writing")
        if self.current in self.leases.values():
            raise Refused("leased")
        self.current = None

    def ls(self, sock):
        if self.current is None and self.writer is None:
            return []
        return [{"name": chaos.SET, "version": self.current or 0, "leases": list(self.leases),
                 "state": "writing" if self.writer is not None else "committed"}]

    def stats(self, sock):
        return {"stopping": False, "leases": len(self.leases)}


def stand_in_worker(svc, rng):
    class Worker:
        count = 0

        def __init__(self, role):
            Worker.count += 1
            self.id, self.role, self.version, self.held = Worker.count, role, None, None

        def _do(self, op, **args):
            if op == "open_write":
                if svc.writer is not None:
                    return {"refused": "writing"}
                svc.versions += 1
                self.version, svc.writer = svc.versions, self.id
                return {"version": self.version, "creates": svc.current is None}
            if op == "fill":
                return {"version": self.version}
            if op in ("commit", "abort"):
                if op == "commit":
                    svc.current = self.version
                svc.writer = None
                return {"version": self.version}
            if op == "attach":
                if svc.current is None:
                    return {"refused": "not_found"}
                self.held = svc.leases[self.id] = svc.current
                return {"values": [float(self.held)], "tensors": chaos.TENSORS, "read_only": True}
            if op == "check":
                return {"values": [float(self.held)], "tensors": chaos.TENSORS}
            svc.leases.pop(self.id, None)
            return {"ok": True}

        def send(self, op, **args):
            if rng.random() < 0.5:  # it arrived before the kill, or not
                self._do(op, **args)

        def call(self, op, **args):
            return self._do(op, **args)

        def kill(self):
            svc.leases.pop(self.id, None)
            if svc.writer == self.id:
                svc.writer = None

        stop = kill

    return Worker


class Alive:
    def poll(self):
        return None


class Rounds(unittest.TestCase):
    def test_the_driver_runs_every_kind_of_round_without_a_false_alarm(self):
        old = chaos.Worker, chaos.time
        # The driver's pauses (a reader holding, a kill's random point)
        # matter only with real processes.
        chaos.time = types.SimpleNamespace(sleep=lambda s: None, monotonic=time.monotonic, time=time.time)
        try:
            for seed in range(3):
                rng = random.Random(seed)
                svc = StandIn()
                chaos.Worker = stand_in_worker(svc, rng)
                c = chaos.Chaos("sock", Alive(), rng)
                c.svc = svc
                c.write("commit")
                for _ in range(600):
                    c.round()
                c.everyone_gone()
                kinds = set(c.counts)
                for kind in ("write commit", "write abort", "write conflict", "write kill_before_open",
                             "write kill_mid_write", "write kill_during_commit", "write kill_after_commit",
                             "attach hold", "attach kill_while_attaching", "drop done", "ls", "stats"):
                    self.assertIn(kind, kinds)
        finally:
            chaos.Worker, chaos.time = old

    def test_an_incomplete_version_is_caught(self):
        c = chaos.Chaos("sock", Alive(), random.Random(0))
        c.committed = {3, 4}
        with self.assertRaisesRegex(AssertionError, "several values"):
            c.check_values({"values": [3.0, 4.0], "tensors": chaos.TENSORS}, 0, "r")
        with self.assertRaisesRegex(AssertionError, "no version whose commit was sent"):
            c.check_values({"values": [5.0], "tensors": chaos.TENSORS}, 0, "r")
        with self.assertRaisesRegex(AssertionError, "older than"):
            c.check_values({"values": [3.0], "tensors": chaos.TENSORS}, 4, "r")
        self.assertEqual(c.check_values({"values": [4.0], "tensors": chaos.TENSORS}, 4, "r"), 4)


if __name__ == "__main__":
    unittest.main()
