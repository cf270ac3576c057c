"""Tests of torch_share.py that need neither torch nor a GPU:
python3 -m unittest discover -s bench (cargo test -p cuda-ipc-bench runs them too)."""

import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_share  # noqa: E402

GIB = 1 << 30


def checksum(sizes):
    """Position-weighted sum, the one weights.rs pins too."""
    return sum((i + 1) * s for i, s in enumerate(sizes)) % (1 << 64)


class WeightSetDraw(unittest.TestCase):
    def test_splitmix64_reference(self):
        # The first output of splitmix64 seeded with 0, as published with it.
        self.assertEqual(torch_share.splitmix64(0)[1], 0xE220A8397B1DCDAF)

    def test_pinned_sizes(self):
        # The same figures are pinned in crates/cuda-ipc-bench/src/weights.rs.
        s = torch_share.weight_set_sizes(100, 4 * GIB)
        self.assertEqual(s[:4], [77560868, 25218624, 68761564, 16600748])
        self.assertEqual((min(s), max(s), checksum(s)), (90716, 87358208, 211502503036))
        s = torch_share.weight_set_sizes(1000, 4 * GIB)
        self.assertEqual(s[:4], [7097292, 2307660, 6292100, 1519072])
        self.assertEqual((min(s), max(s), checksum(s)), (8304, 8302844, 2210082048708))

    def test_sizes_sum_and_units(self):
        for count, total in [(1, 4), (3, 12), (100, 400), (7, 1 << 20), (1000, 256 << 20), (10000, 4 * GIB)]:
            s = torch_share.weight_set_sizes(count, total)
            self.assertEqual(len(s), count)
            self.assertEqual(sum(s), total)
            self.assertTrue(all(x >= 4 and x % 4 == 0 for x in s))

    def test_bad_sets_are_refused(self):
        for count, total in [(0, 4), (2, 4), (1, 6), (1, 0), (100001, 1 << 30)]:
            with self.assertRaises(ValueError):
                torch_share.weight_set_sizes(count, total)
        with self.assertRaises(ValueError):
            torch_share.parse_sets("100:4096")
        self.assertEqual(torch_share.parse_sets("2:512:1:3"), [(2, 512, 1, 3)])
        with self.assertRaises(ValueError):
            torch_share.parse_sets("2:4:1:3")

    def test_print_sizes(self):
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_share.py")
        out = subprocess.run(
            [sys.executable, script, "--print-sizes", "100:%d" % (4 * GIB)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        self.assertEqual(json.loads(out), torch_share.weight_set_sizes(100, 4 * GIB))

    def test_values_are_exact_in_fp32(self):
        for args in [(0, 0, 0), (1, 29, 999), (5, 1000, 9999)]:
            v = torch_share.set_value(*args)
            self.assertTrue(0 <= v < (1 << 24) and v == int(v))

    def test_a_polling_get_takes_what_comes_and_times_out_after_its_poll(self):
        import queue
        import time

        q = queue.Queue()
        q.put("x")
        t = time.perf_counter()
        self.assertEqual(torch_share.get_polling(q, 60.0), "x")
        self.assertLess(time.perf_counter() - t, 10)
        t = time.perf_counter()
        with self.assertRaises(queue.Empty):
            torch_share.get_polling(q, 0.02, timeout=0.01)
        self.assertGreaterEqual(time.perf_counter() - t, 0.03)


if __name__ == "__main__":
    unittest.main()
