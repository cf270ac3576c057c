"""PyTorch share records and storage handles, on the recorded cases shared
with the Rust tests (crates/cuda-ipc/tests/data/torch/cases.json). No GPU."""

import json
import os
import struct
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402,F401

from cuda_ipc import TorchRecordError, CudaIpcError  # noqa: E402
from cuda_ipc.torch_record import (  # noqa: E402
    parse_storage_handle,
    record_to_descriptor,
    record_to_json,
    tensor_layout,
    validate_record,
)


def load_cases():
    with open(_path.CASES) as f:
        return json.load(f)["cases"]


class RecordedCases(unittest.TestCase):
    def test_every_case_converts_like_the_rust_converter(self):
        cases = load_cases()
        self.assertGreater(len(cases), 50)
        for case in cases:
            with self.subTest(case=case["name"]):
                if "descriptor" in case:
                    got = record_to_descriptor(case["record"])
                    self.assertEqual(got, case["descriptor"])
                else:
                    with self.assertRaises(CudaIpcError) as cm:
                        record_to_descriptor(case["record"])
                    self.assertIn(case["error"], str(cm.exception))
                    self.assertIsInstance(cm.exception, ValueError)

    def test_valid_records_round_trip(self):
        for case in load_cases():
            try:
                r = validate_record(case["record"])
            except TorchRecordError:
                continue
            with self.subTest(case=case["name"]):
                again = validate_record(json.dumps(record_to_json(r)))
                self.assertEqual(again, r)


class RealRecords(unittest.TestCase):
    """Records a real PyTorch wrote (crates/cuda-ipc/tests/data/torch/recorded)."""

    def test_recorded_records(self):
        folder = os.path.join(os.path.dirname(_path.CASES), "recorded")
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json")) if os.path.isdir(folder) else []
        if not names:
            self.skipTest("no recorded PyTorch share records yet (see recorded/README.md)")
        for name in names:
            with self.subTest(name), open(os.path.join(folder, name)) as f:
                doc = json.load(f)
                r = validate_record(doc["record"])
                h = parse_storage_handle(r["storage_handle"])
                self.assertEqual(h["version"], doc["handle_version"])
                self.assertEqual(h["type"], doc["handle_type"])
                if doc["expect"] == "segments":
                    with self.assertRaisesRegex(TorchRecordError, "import_segments"):
                        record_to_descriptor(r)
                    tensor_layout(r)
                else:
                    self.assertEqual(record_to_descriptor(r)["mechanism"], doc["expect"])


def seg(version, fds, pid=4242, size=2 << 20):
    b = bytes([version]) + b"e" + struct.pack("<i4xQQ", pid, size, len(fds))
    if version >= 3:
        b += struct.pack("<i4x", 1)
    return b + b"".join(struct.pack("<i", f) for f in fds)


class StorageHandles(unittest.TestCase):
    def test_c_handles(self):
        for v in (2, 3):
            h = parse_storage_handle(bytes([v]) + b"c" + bytes(range(1, 65)))
            self.assertEqual(h, {"type": "c", "version": v, "handle": bytes(range(1, 65))})

    def test_e_handle_parsed_fully(self):
        b = seg(2, list(range(30, 40)))
        self.assertEqual(len(b), 66)
        h = parse_storage_handle(b)
        self.assertEqual(h["pid"], 4242)
        self.assertEqual(h["segment_size"], 2 << 20)
        self.assertEqual(h["kind"], "fd")
        self.assertEqual(h["handles"], list(range(30, 40)))
        h3 = parse_storage_handle(seg(3, [7, 8]))
        self.assertEqual(h3["handles"], [7, 8])
        self.assertEqual(h3["version"], 3)

    def test_fabric_by_length(self):
        b = bytes([2]) + b"e" + struct.pack("<i4xQQ", 99, 20 << 20, 2) + bytes([9]) * 128
        h = parse_storage_handle(b)
        self.assertEqual(h["kind"], "fabric")
        self.assertEqual(h["handles"], [bytes([9]) * 64] * 2)

    def test_errors_name_version_and_type(self):
        with self.assertRaisesRegex(TorchRecordError, r"version 9 \(type byte 0x71 \('q'\)\)"):
            parse_storage_handle(bytes([9]) + b"q" + bytes(64))
        with self.assertRaisesRegex(TorchRecordError, r"version 2 has type byte 0x00"):
            parse_storage_handle(bytes([2, 0]) + bytes(64))
        for short in (b"", b"\x02"):
            with self.assertRaisesRegex(TorchRecordError, "version byte and a type byte"):
                parse_storage_handle(short)

    def test_arbitrary_bytes_never_crash(self):
        import random
        rng = random.Random(7)
        for _ in range(3000):
            n = rng.randrange(0, 120)
            b = bytes([rng.choice([2, 3, rng.randrange(256)]), rng.choice([99, 101, rng.randrange(256)])])
            b += bytes(rng.randrange(256) for _ in range(n))
            try:
                parse_storage_handle(b)
            except TorchRecordError:
                pass


class Layouts(unittest.TestCase):
    def record(self, size, stride, offset=0, storage=4096, dtype="float32"):
        return {"tensor_size": size, "tensor_stride": stride, "tensor_offset": offset,
                "storage_size_bytes": storage, "storage_offset_bytes": 64, "dtype": dtype}

    def test_transposed_keeps_strides(self):
        lay = tensor_layout(self.record([5, 3], [1, 5]))
        self.assertEqual(lay, {"offset": 64, "len": 60, "dtype": "f32", "shape": [5, 3], "strides": [1, 5]})

    def test_permuted_3d(self):
        # x = empty(2, 3, 4).permute(2, 0, 1): size [4, 2, 3], stride [1, 12, 4]
        lay = tensor_layout(self.record([4, 2, 3], [1, 12, 4], dtype="int16"))
        self.assertEqual(lay["len"], 24 * 2)
        self.assertEqual(lay["strides"], [1, 12, 4])

    def test_overlap_refused(self):
        with self.assertRaisesRegex(TorchRecordError, "overlapping"):
            tensor_layout(self.record([4, 4], [1, 1]))


if __name__ == "__main__":
    unittest.main()
