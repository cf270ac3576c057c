"""Every element type a checkpoint carries, without a GPU or torch: the
fp8, fp4 and complex rows of the dtype table (as the Rust library has
them), PyTorch names both ways, the raw types views fall back to, CUDA
array interfaces and set records of the new types, the run planner on
them, and state dicts whose types a set cannot hold refused before
anything is allocated."""

import json
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402,F401

import cuda_ipc  # noqa: E402
from cuda_ipc import cuda_array_interface, dtypes, sets, validate_descriptor  # noqa: E402
from cuda_ipc import mapping as _mapping  # noqa: E402
from cuda_ipc import _torch_c  # noqa: E402
from test_state_dict import _publisher  # noqa: E402

# Written here by hand, independently of the extension's table:
# (name, torch, numpy, typestr, size, raw_typestr, raw_numpy, raw).
NEW_ROWS = [
    ("f8e4m3fn", "float8_e4m3fn", "float8_e4m3fn", "|V1", 1, "|u1", "uint8", "u8"),
    ("f8e5m2", "float8_e5m2", "float8_e5m2", "|V1", 1, "|u1", "uint8", "u8"),
    ("f8e4m3fnuz", "float8_e4m3fnuz", "float8_e4m3fnuz", "|V1", 1, "|u1", "uint8", "u8"),
    ("f8e5m2fnuz", "float8_e5m2fnuz", "float8_e5m2fnuz", "|V1", 1, "|u1", "uint8", "u8"),
    ("f8e8m0fnu", "float8_e8m0fnu", "float8_e8m0fnu", "|V1", 1, "|u1", "uint8", "u8"),
    ("f4e2m1fnx2", "float4_e2m1fn_x2", "float4_e2m1fn_x2", "|V1", 1, "|u1", "uint8", "u8"),
    ("c64", "complex64", "complex64", "<c8", 8, "<i8", "int64", "i64"),
    ("c128", "complex128", "complex128", "<c16", 16, "|V16", "void128", "c128"),
]
FP8_FP4 = {"f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz", "f8e8m0fnu", "f4e2m1fnx2"}
UUID = "GPU-12345678-1234-1234-1234-123456789abc"


def _row(d):
    return (d.name, d.torch, d.numpy, d.typestr, d.size, d.raw_typestr, d.raw_numpy, d.raw)


class Table(unittest.TestCase):
    def test_the_new_rows(self):
        for want in NEW_ROWS:
            with self.subTest(dtype=want[0]):
                self.assertEqual(_row(dtypes.by_name(want[0])), want)
        self.assertEqual([_row(d) for d in dtypes.DTYPES[-len(NEW_ROWS):]], NEW_ROWS)
        self.assertEqual(len(dtypes.DTYPES), 21)

    def test_the_table_is_the_extensions(self):
        self.assertEqual([_row(d) for d in dtypes.DTYPES], [tuple(r) for r in cuda_ipc._core.dtype_table()])

    def test_every_name_column_is_unique(self):
        for column in ("name", "torch", "numpy"):
            values = [getattr(d, column) for d in dtypes.DTYPES]
            self.assertEqual(len(set(values)), len(values), column)

    def test_raw_is_a_row_of_the_same_size(self):
        for d in dtypes.DTYPES:
            with self.subTest(dtype=d.name):
                raw = dtypes.by_name(d.raw)
                self.assertEqual(raw.size, d.size)
                self.assertEqual(raw.raw, raw.name)
                if d.name != "c128":
                    self.assertEqual((raw.typestr, raw.numpy), (d.raw_typestr, d.raw_numpy))
                    self.assertIn(raw.name[0], "ui")

    def test_raw_name(self):
        self.assertEqual(dtypes.raw_name("f8e4m3fn"), "u8")
        self.assertEqual(dtypes.raw_name("f4e2m1fnx2"), "u8")
        self.assertEqual(dtypes.raw_name("bf16"), "i16")
        self.assertEqual(dtypes.raw_name("bool"), "u8")
        self.assertEqual(dtypes.raw_name("u32"), "i32")
        self.assertEqual(dtypes.raw_name("c64"), "i64")
        self.assertEqual(dtypes.raw_name("c128"), "c128")
        self.assertEqual(dtypes.raw_name("f8e4m3fn", raw=False), "f8e4m3fn")
        self.assertEqual(dtypes.raw_name("unknown"), "unknown")

    def test_bits_only_are_the_fp8_and_fp4_types(self):
        self.assertEqual(set(dtypes.BITS_ONLY), FP8_FP4)
        self.assertTrue(FP8_FP4 <= _mapping._TORCH_RAW)
        self.assertNotIn("c64", _mapping._TORCH_RAW)
        self.assertNotIn("c128", _mapping._TORCH_RAW)


class TorchNames(unittest.TestCase):
    def test_both_ways_without_torch(self):
        for name, torch_name, *_ in NEW_ROWS:
            with self.subTest(dtype=torch_name):
                self.assertEqual(dtypes.from_torch(torch_name).name, name)
                self.assertEqual(dtypes.from_torch("torch." + torch_name).name, name)
                self.assertEqual(dtypes.lookup(torch_name).name, name)
                self.assertEqual(dtypes.by_name(name).torch, torch_name)
                self.assertEqual(cuda_ipc._core.dtype_from_torch(torch_name), name)
                self.assertEqual(sets.set_dtype(torch_name).name, name)

    def test_types_without_a_row_are_refused_naming_them(self):
        for bad in ("uint4", "uint1", "int7", "complex32", "qint8", "quint4x2", "bits8"):
            with self.subTest(dtype=bad):
                self.assertIsNone(dtypes.from_torch(bad))
                with self.assertRaises(cuda_ipc.InvalidInput) as cm:
                    sets.set_dtype("torch." + bad, "'layers.0.w'")
                msg = str(cm.exception)
                self.assertIn(f"'layers.0.w' is {bad}, which a set does not hold", msg)
                self.assertIn("float8_e4m3fn", msg)
                self.assertIn("t.view(torch.uint8)", msg)
                with self.assertRaises(ValueError) as cm:
                    cuda_ipc._core.dtype_from_torch(bad)
                self.assertIn(f'"{bad}" cannot be shared', str(cm.exception))
                self.assertIn("view the tensor as uint8 first (t.view(torch.uint8))", str(cm.exception))


def _legacy(**changes):
    d = {"cuda_ipc": 1, "mechanism": "legacy", "handle": "ab" * 64, "alloc_size": 2 << 20,
         "offset": 0, "len": 4096, "dtype": "u8", "elem_size": 1, "device_uuid": UUID, "pid": 4242}
    d.update(changes)
    return d


class ArrayInterface(unittest.TestCase):
    def test_typestrs_of_the_new_types(self):
        for name, _torch, _np, typestr, size, raw_typestr, *_ in NEW_ROWS:
            with self.subTest(dtype=name):
                d = validate_descriptor(_legacy(dtype=name, elem_size=size, shape=[4, 4], len=16 * size))
                self.assertEqual(d["dtype"], name)
                cai = cuda_array_interface(0x1000, d)
                self.assertEqual((cai["typestr"], cai["shape"]), (typestr, (4, 4)))
                self.assertEqual(cuda_array_interface(0x1000, d, raw=True)["typestr"], raw_typestr)

    def test_strides_count_bytes_of_16_byte_elements(self):
        d = validate_descriptor(_legacy(dtype="c128", elem_size=16, len=16 * 9, shape=[3, 3], strides=[1, 3]))
        self.assertEqual(cuda_array_interface(0, d)["strides"], (16, 48))

    def test_a_wrong_element_size_names_the_field(self):
        with self.assertRaises(cuda_ipc.DescriptorError) as cm:
            validate_descriptor(_legacy(dtype="c128", elem_size=8, len=64))
        self.assertEqual(cm.exception.field, "elem_size")


def _set_record(entries, version=1):
    chunk = {"id": 0, "descriptor": {"cuda_ipc": 1, "mechanism": "vmm", "fd": 7, "alloc_size": 2 << 20,
                                     "offset": 0, "len": 2 << 20, "dtype": "u8", "elem_size": 1,
                                     "device_uuid": UUID, "pid": 4242, "generation": 7}}
    return {"cuda_ipc_set": version, "name": "fp8-model", "arena": 9, "chunks": [chunk], "entries": entries}


class SetRecords(unittest.TestCase):
    def entries(self):
        out, offset = [], 0
        for name, _torch, _np, _ts, size, *_ in NEW_ROWS:
            out.append([f"w.{name}", name, [3, 5], 0, offset, 15 * size])
            offset += 256
        return out

    def test_every_new_type_round_trips(self):
        entries = self.entries()
        back = sets.parse_set_record(json.dumps(_set_record(entries)))
        self.assertEqual(back["entries"], entries)
        for i, (name, *_rest) in enumerate(NEW_ROWS):
            d = sets.set_entry_descriptor(_set_record(entries), i)
            self.assertEqual((d["dtype"], d["shape"], d["offset"]), (name, [3, 5], 256 * i))

    def test_a_misaligned_complex128_entry_is_refused(self):
        entries = [["z", "c128", [2], 0, 8, 32]]
        with self.assertRaises(cuda_ipc.DescriptorError) as cm:
            sets.parse_set_record(_set_record(entries))
        self.assertIn("16-byte c128", str(cm.exception))

    def test_runs_of_the_new_types(self):
        c, mib = 1 << 40, 1 << 20
        runs, places = cuda_ipc._core.plan_runs([
            (c, mib, c, 16 * 4, "c128", [2, 2]),
            (c, mib, c + 256, 16 * 3, "c128", [3]),
            (c, mib, c + 512, 6, "f4e2m1fnx2", [2, 3]),
            (c, mib, c + 768, 5, "f8e4m3fn", [5]),
        ])
        self.assertEqual(runs, [(c, 256 + 48, "c128"), (c + 512, 6, "f4e2m1fnx2"), (c + 768, 5, "f8e4m3fn")])
        self.assertEqual(places, [(0, 0, [2, 1]), (0, 16, [1]), (1, 0, [3, 1]), (2, 0, [1])])


# --- publish_state_dict refuses before it allocates -------------------------------


class _Dtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return "torch." + self.name

    __repr__ = __str__


class _Tensor:
    """A host tensor's surface, as far as publish_state_dict's plan reads it."""

    is_cuda = False

    def __init__(self, dtype, shape, size, ptr):
        self.dtype, self.shape, self.ptr = _Dtype(dtype), tuple(shape), ptr
        self.nbytes = size
        for d in shape:
            self.nbytes *= d

    def data_ptr(self):
        return self.ptr


class _StubTorch:
    Tensor = _Tensor

    def __getattr__(self, name):
        raise AssertionError(f"publish_state_dict reached torch.{name} before refusing")


class RefusedBeforeAllocation(unittest.TestCase):
    def setUp(self):
        self.saved = _mapping._loaded.get("torch")
        _mapping._loaded["torch"] = _StubTorch()
        # The stand-in has no DLPack C exchange API: the Python path.
        self.saved_choice = _torch_c._use(None, "a stand-in torch")

    def tearDown(self):
        _torch_c._restore(self.saved_choice)
        if self.saved is None:
            _mapping._loaded.pop("torch", None)
        else:
            _mapping._loaded["torch"] = self.saved

    def publisher(self):
        # A publisher whose core records every call and allocates nothing.
        return _publisher()

    def test_a_sub_byte_tensor_after_good_ones(self):
        for bad in ("uint4", "int1", "complex32"):
            with self.subTest(dtype=bad):
                p = self.publisher()
                sd = {
                    "w.fp8": _Tensor("float8_e4m3fn", [64, 64], 1, 0x1000),
                    "w.fp4": _Tensor("float4_e2m1fn_x2", [64, 32], 1, 0x3000),
                    "w.c": _Tensor("complex128", [8], 16, 0x5000),
                    "w.bf16": _Tensor("bfloat16", [64], 2, 0x6000),
                    "w.packed": _Tensor(bad, [128], 1, 0x7000),
                }
                with self.assertRaises(cuda_ipc.InvalidInput) as cm:
                    p.publish_state_dict("model", sd)
                msg = str(cm.exception)
                self.assertIn(f"'w.packed' is {bad}", msg)
                self.assertIn("t.view(torch.uint8)", msg)
                # Nothing reserved, allocated or published: the plan refused first.
                self.assertEqual(p._c.calls, [])
                self.assertEqual((p._sets, p._state_dicts), (set(), {}))


if __name__ == "__main__":
    unittest.main()
