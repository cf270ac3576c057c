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


if __name__ == "__main__":
    unittest.main()
