"""Set records through the library's decoder, on the seeds of the fuzz
target (fuzz/corpus/set_record): the valid ones decode and give one
descriptor per entry, the others are refused naming what is wrong. No GPU."""

import json
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402

import cuda_ipc  # noqa: E402
from cuda_ipc.sets import parse_set_record, set_entry_descriptor  # noqa: E402

SEEDS = os.path.join(_path.REPO, "fuzz", "corpus", "set_record")


def seeds(prefix):
    if not os.path.isdir(SEEDS):
        return []
    return sorted(n for n in os.listdir(SEEDS) if n.startswith(prefix))


@unittest.skipUnless(seeds("seed-valid"), "no set record seeds in this checkout")
class SetRecords(unittest.TestCase):
    def read(self, name):
        with open(os.path.join(SEEDS, name), "rb") as f:
            return f.read()

    def test_valid_records_give_a_descriptor_per_entry(self):
        for name in seeds("seed-valid"):
            with self.subTest(seed=name):
                rec = parse_set_record(self.read(name))
                self.assertEqual(parse_set_record(json.dumps(rec)), rec)
                for i, entry in enumerate(rec["entries"]):
                    d = set_entry_descriptor(rec, i)
                    self.assertEqual(d["shape"], entry[2])
                    self.assertEqual(d["len"], entry[5])
                    self.assertEqual(cuda_ipc.parse_descriptor(d), d)
                with self.assertRaises(cuda_ipc.InvalidInput):
                    set_entry_descriptor(rec, len(rec["entries"]))

    def test_invalid_records_are_refused(self):
        for name in seeds("seed-"):
            if name.startswith("seed-valid"):
                continue
            with self.subTest(seed=name):
                with self.assertRaises(cuda_ipc.DescriptorError) as cm:
                    parse_set_record(self.read(name))
                self.assertTrue(str(cm.exception), name)


class RunPlanning(unittest.TestCase):
    """How an attached set's entries are grouped into runs, each imported
    once through DLPack (``SetAttachment.runs``), by the planner alone."""

    MIB = 1 << 20

    def plan(self, entries):
        return cuda_ipc._core.plan_runs(entries)

    def test_entries_of_one_chunk_and_dtype_share_a_run(self):
        c = 1 << 40
        runs, places = self.plan([
            (c, 2 * self.MIB, c + 512, 4 * 6, "f32", [2, 3]),
            (c, 2 * self.MIB, c + 256, 4 * 4, "f32", [4]),
            (c, 2 * self.MIB, c + 4096, 4, "f32", []),
        ])
        self.assertEqual(runs, [(c + 256, 4096 + 4 - 256, "f32")])
        self.assertEqual(places, [(0, (512 - 256) // 4, [3, 1]), (0, 0, [1]), (0, (4096 - 256) // 4, [])])

    def test_chunks_dtypes_and_phases_make_runs_of_their_own(self):
        a, b = 1 << 40, (1 << 40) + 64 * self.MIB
        runs, places = self.plan([
            (a, self.MIB, a, 8, "f32", [2]),
            (b, self.MIB, b, 8, "f32", [2]),  # another chunk
            (a, self.MIB, a + 256, 8, "i64", [1]),  # another dtype
            (a, self.MIB, a + 258, 4, "f32", [1]),  # not a whole f32 from the first
            (a, self.MIB, a + 512, 8, "f32", [2]),
        ])
        self.assertEqual(len(runs), 4)
        self.assertEqual([p[0] for p in places], [0, 1, 2, 3, 0])
        self.assertEqual(runs[0], (a, 520, "f32"))
        self.assertEqual(places[4], (0, 128, [1]))

    def test_entries_that_fit_no_run_are_made_on_their_own(self):
        c = 1 << 40
        runs, places = self.plan([
            (c, self.MIB, c, 10, "f32", [2]),  # 10 bytes for 2 floats
            (c, self.MIB, c, 0, "f32", [0]),  # no bytes
            (c, self.MIB, c + self.MIB - 4, 8, "f32", [2]),  # past the chunk's end
            (c, self.MIB, c - 8, 8, "f32", [2]),  # before the chunk
            (c, self.MIB, c, 1 << 62, "u8", [1 << 31, 1 << 31, 1 << 31]),  # the count overflows
        ])
        self.assertEqual(runs, [])
        self.assertEqual(places, [None] * 5)

    def test_unknown_dtype_is_invalid_input(self):
        with self.assertRaises(cuda_ipc.InvalidInput):
            self.plan([(0, 64, 0, 4, "f33", [1])])

    def test_random_sets_every_place_is_its_entry(self):
        import random

        sizes = {"u8": 1, "f16": 2, "bf16": 2, "f32": 4, "i64": 8, "f64": 8}
        for seed in range(200):
            rng = random.Random(seed)
            chunks = [((k + 1) << 36, rng.choice([self.MIB, 2 * self.MIB])) for k in range(rng.randint(1, 3))]
            entries = []
            for _ in range(rng.randint(1, 40)):
                chunk, size = rng.choice(chunks)
                dtype = rng.choice(list(sizes))
                shape = [rng.randint(1, 5) for _ in range(rng.randint(0, 3))]
                count = 1
                for d in shape:
                    count *= d
                nbytes = count * sizes[dtype]
                if rng.random() < 0.1:
                    nbytes += 1
                ptr = chunk + rng.randrange(0, size - 64, rng.choice([1, 2, 256]))
                entries.append((chunk, size, ptr, nbytes, dtype, shape))
            runs, places = self.plan(entries)
            for (chunk, size, ptr, nbytes, dtype, shape), place in zip(entries, places):
                with self.subTest(seed=seed, entry=(ptr, nbytes, dtype, shape)):
                    fits = ptr + nbytes <= chunk + size and nbytes == sizes[dtype] * (nbytes // sizes[dtype]) \
                        and nbytes == sizes[dtype] * _count(shape)
                    if place is None:
                        self.assertFalse(fits, "an entry that fits a run was left out")
                        continue
                    self.assertTrue(fits, "an entry that fits no run was placed")
                    run, offset, strides = place
                    start, length, run_dtype = runs[run]
                    self.assertEqual(run_dtype, dtype)
                    self.assertEqual(start + offset * sizes[dtype], ptr)
                    self.assertTrue(chunk <= start and ptr + nbytes <= start + length <= chunk + size)
                    self.assertEqual(length % sizes[dtype], 0)
                    self.assertEqual(strides, [_count(shape[i + 1:]) for i in range(len(shape))])


def _count(shape):
    n = 1
    for d in shape:
        n *= d
    return n




class LazyEntries(unittest.TestCase):
    """A SetAttachment builds its per-entry tuples on first use only (the C
    exchange API's attach never asks for them), once."""

    class Core:
        def __init__(self):
            self.asked = 0

        @property
        def entries(self):
            self.asked += 1
            return [("w", "float32", (2,), 0x1000, 8), ("b", "float32", (), 0x1100, 4)]

    def test_entries_are_read_once_and_only_when_used(self):
        from cuda_ipc.sets import SetAttachment

        core = self.Core()
        a = SetAttachment(core)
        self.assertEqual(core.asked, 0)
        self.assertEqual(len(a), 2)
        self.assertEqual(a.names, ["w", "b"])
        self.assertEqual(a.entries[1][0], "b")
        self.assertEqual(core.asked, 1)


if __name__ == "__main__":
    unittest.main()
