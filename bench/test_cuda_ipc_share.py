"""Tests of cuda_ipc_share.py that need neither torch nor a GPU:
python3 -m unittest discover -s bench."""

import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cuda_ipc_share  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_ipc_share.py")

# Hides cuda_ipc (and torch) even where they are installed, then runs the script.
HIDE = """
import runpy, sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in (%r,):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
sys.argv = [%r] + %r
runpy.run_path(%r, run_name="__main__")
"""


def run_hiding(module, args):
    code = HIDE % (module, SCRIPT, args, SCRIPT)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def lines(out):
    return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


class Script(unittest.TestCase):
    def test_without_cuda_ipc_it_skips_saying_why(self):
        out = run_hiding("cuda_ipc", ["--device", "0", "--sets", "100:4096:1:2"])
        self.assertEqual(out.returncode, 0, out.stderr)
        got = lines(out)
        self.assertEqual(len(got), 1, got)
        self.assertEqual(got[0]["kind"], "skip")
        self.assertIn("cuda_ipc is not importable", got[0]["reason"])
        self.assertIn("pip install", got[0]["reason"])

    def test_without_torch_it_skips(self):
        out = run_hiding("torch", ["--device", "0", "--plan", "4096:1:2"])
        self.assertEqual(out.returncode, 0, out.stderr)
        got = lines(out)
        self.assertEqual(got[-1]["kind"], "skip", got)

    def test_a_bad_plan_is_an_error_line(self):
        for args in (["--plan", "4095:1:2"], ["--sets", "10:12:1:2"], ["--sets", "1:4:0"]):
            with self.subTest(args=args):
                out = subprocess.run([sys.executable, SCRIPT, "--device", "0"] + args, capture_output=True,
                                     text=True, timeout=60)
                self.assertEqual(out.returncode, 2, out.stderr)
                got = lines(out)
                self.assertEqual([g["kind"] for g in got], ["error"])

    def test_sample_values_are_exact_in_fp32(self):
        import struct

        for i, k in ((0, 0), (7, 999), (12, 123456)):
            v = cuda_ipc_share.sample_value(i, k)
            self.assertEqual(struct.unpack("f", struct.pack("f", v))[0], v)
            self.assertEqual(v, int(v))
        self.assertNotEqual(cuda_ipc_share.sample_value(1, 0), cuda_ipc_share.sample_value(2, 0))


class Awake(unittest.TestCase):
    def test_the_poll_is_read_as_the_bench_reads_it(self):
        spin = cuda_ipc_share.awake_spin_s
        self.assertEqual(spin({}), 0.0)
        self.assertEqual(spin({"CUDA_IPC_BENCH_AWAKE_US": ""}), 0.0)
        self.assertEqual(spin({"CUDA_IPC_BENCH_AWAKE_US": " 250 "}), 250e-6)
        self.assertEqual(spin({"CUDA_IPC_BENCH_AWAKE_US": "50000"}), 0.05)
        for bad in ("50001", "-1", "1.5", "20ms"):
            self.assertEqual(spin({"CUDA_IPC_BENCH_AWAKE_US": bad}), 0.0, bad)

    def test_a_poll_ends_when_a_line_comes_or_its_time_is_up(self):
        import time

        r, w = os.pipe()
        with os.fdopen(r) as f, os.fdopen(w, "w") as out:
            t = time.perf_counter()
            cuda_ipc_share.await_line(f, 0.02)
            self.assertGreaterEqual(time.perf_counter() - t, 0.02)
            out.write("{}\n")
            out.flush()
            t = time.perf_counter()
            cuda_ipc_share.await_line(f, 60)
            self.assertLess(time.perf_counter() - t, 10)
            self.assertEqual(f.readline(), "{}\n")


class Collector(unittest.TestCase):
    def test_the_clock_records_each_collection_with_its_generation(self):
        import gc

        clock = cuda_ipc_share.GcClock()
        try:
            before = cuda_ipc_share.now_ns()
            gc.collect(0)
            gc.collect(2)
            after = cuda_ipc_share.now_ns()
            self.assertEqual([g for _, _, g in clock.spans], [0, 2])
            for began, ended, _ in clock.spans:
                self.assertLessEqual(before, began)
                self.assertLessEqual(began, ended)
                self.assertLessEqual(ended, after)
            clock.clear()
            self.assertEqual(clock.spans, [])
        finally:
            clock.close()
        gc.collect(0)
        self.assertEqual(clock.spans, [], "a closed clock records nothing")

    def test_only_what_lies_inside_the_clock_counts(self):
        inside = cuda_ipc_share.gc_inside
        spans = [(0, 1_000_000, 0), (5_000_000, 7_000_000, 2), (9_000_000, 12_000_000, 1)]
        self.assertEqual(inside(spans, 0, 20_000_000), (6.0, 2.0))
        # Clipped at both ends: half of the first, the full one, none of the last.
        self.assertEqual(inside(spans, 500_000, 8_000_000), (2.5, 2.0))
        self.assertEqual(inside(spans, 6_000_000, 10_000_000), (2.0, 1.0))
        self.assertEqual(inside(spans, 13_000_000, 14_000_000), (0.0, 0.0))
        self.assertEqual(inside([], 0, 1), (0.0, 0.0))

    def test_a_sample_counts_both_processes_collections_inside_its_clock(self):
        # The consumer's spans come back through JSON, as lists.
        ans = json.loads(json.dumps({"t_ns": 10_000_000, "t_recv": 4_000_000, "t_mid": None, "phases": {},
                                     "gc": [(5_000_000, 6_000_000, 0), (9_000_000, 12_000_000, 2)]}))
        producer = [(500_000, 1_500_000, 1), (12_000_000, 13_000_000, 2)]
        parts = {"publish": [], "request": [], "consumer": []}
        cuda_ipc_share.keep_parts(parts, 1_000_000, 2_000_000, ans, producer)
        self.assertEqual(parts["publish"], [1.0])
        self.assertEqual(parts["request"], [2.0])
        self.assertEqual(parts["consumer"], [6.0])
        # Inside 1..10 ms: half of the producer's first, the consumer's first
        # and 1 ms of its full one; nothing after the clock stopped.
        self.assertEqual(parts["gc"], [2.5])
        self.assertEqual(parts["gc_full"], [1.0])

    def test_each_sample_adds_both_parts(self):
        parts = {}
        cuda_ipc_share.add_gc(parts, [(1_000_000, 3_000_000, 2)], {"t_ns": 2_000_000}, 0)
        cuda_ipc_share.add_gc(parts, [], {"t_ns": 2_000_000, "gc": []}, 0)
        self.assertEqual(parts, {"gc": [1.0, 0.0], "gc_full": [1.0, 0.0]})


class ConsumerProcess(unittest.TestCase):
    """The consumer helper that first_attach.py reuses, with a stand-in script."""

    def test_a_stand_in_script_gets_its_arguments_and_answers(self):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "echo.py")
            with open(script, "w") as f:
                f.write("import json, sys\n"
                        "print(json.dumps({'argv': sys.argv[1:]}), flush=True)\n"
                        "for line in sys.stdin:\n"
                        "    print(json.dumps({'got': json.loads(line)}), flush=True)\n")
            before = cuda_ipc_share.now_ns()
            c = cuda_ipc_share.Consumer(3, "/tmp/x.sock", script=script, args=["--extra"])
            try:
                self.assertGreaterEqual(c.started_ns, before)
                self.assertEqual(c.read(), {"argv": ["--consumer", "/tmp/x.sock", "--device", "3", "--extra"]})
                self.assertEqual(c.ask({"op": "x"}), {"got": {"op": "x"}})
            finally:
                c.close()
            self.assertEqual(c.p.returncode, 0)

    def test_a_consumer_that_exits_is_an_error(self):
        c = cuda_ipc_share.Consumer(0, "/nonexistent.sock", script=os.devnull)
        try:
            with self.assertRaisesRegex(RuntimeError, "the consumer exited"):
                c.read()
        finally:
            c.close()


if __name__ == "__main__":
    unittest.main()
