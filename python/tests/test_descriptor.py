"""Descriptor validation (the rules of the Rust descriptor.rs), the CUDA
array interface built from a descriptor, and the dtype tables. No GPU."""

import json
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402,F401

import cuda_ipc  # noqa: E402
from cuda_ipc import DescriptorError, cuda_array_interface, dtypes, parse_descriptor, validate_descriptor  # noqa: E402

UUID = "GPU-12345678-9abc-def0-0102-030405060708"
H = "ab" * 64


def legacy(**changes):
    d = {"cuda_ipc": 1, "mechanism": "legacy", "handle": H, "alloc_size": 2 << 20, "offset": 0,
         "len": 4096, "dtype": "u32", "elem_size": 4, "device_uuid": UUID, "pid": 4242}
    for k, v in changes.items():
        if v is ...:
            d.pop(k, None)
        else:
            d[k] = v
    return d


class Valid(unittest.TestCase):
    def test_every_mechanism(self):
        self.assertEqual(validate_descriptor(legacy())["handle"], H)
        vmm = legacy(mechanism="vmm", handle=..., fd=7)
        self.assertEqual(validate_descriptor(vmm)["fd"], 7)
        pool = legacy(mechanism="pool", fd=9)
        self.assertEqual(validate_descriptor(pool)["fd"], 9)
        fabric = legacy(mechanism="fabric")
        self.assertEqual(validate_descriptor(fabric)["mechanism"], "fabric")

    def test_normalises(self):
        d = validate_descriptor(legacy(handle=H.upper(), elem_size=..., event=None, device_uuid=UUID.upper().replace("GPU", "GPU")))
        self.assertEqual(d["handle"], H)
        self.assertEqual(d["elem_size"], 4)
        self.assertNotIn("event", d)
        self.assertTrue(d["device_uuid"].startswith("GPU-12345678"))

    def test_json_text_and_bytes(self):
        text = json.dumps(legacy(shape=[32, 32]))
        self.assertEqual(parse_descriptor(text)["shape"], [32, 32])
        self.assertEqual(parse_descriptor(text.encode())["shape"], [32, 32])

    def test_strides_within_range(self):
        d = legacy(len=60 * 4, shape=[5, 3], strides=[1, 5], dtype="f32")
        self.assertEqual(validate_descriptor(d)["strides"], [1, 5])

    def test_every_dtype(self):
        for dt in dtypes.DTYPES:
            d = validate_descriptor(legacy(dtype=dt.name, elem_size=dt.size, len=8 * dt.size))
            self.assertEqual(d["elem_size"], dt.size)


class Invalid(unittest.TestCase):
    CASES = [
        ("not an object", [1], "(document)", "expected a JSON object"),
        ("unknown field", legacy(colour=1), "colour", "unknown field"),
        ("version missing", legacy(cuda_ipc=...), "cuda_ipc", "missing"),
        ("version 2", legacy(cuda_ipc=2), "cuda_ipc", "format 2 is not supported"),
        ("version bool", legacy(cuda_ipc=True), "cuda_ipc", "found a boolean"),
        ("mechanism", legacy(mechanism="magic"), "mechanism", "is not one of"),
        ("legacy with fd", legacy(fd=3), "fd", "does not belong to a legacy"),
        ("vmm with handle", legacy(mechanism="vmm", fd=3), "handle", "does not belong to a vmm"),
        ("vmm without fd", legacy(mechanism="vmm", handle=...), "fd", "missing"),
        ("pool without handle", legacy(mechanism="pool", fd=3, handle=...), "handle", "missing"),
        ("fd too large", legacy(mechanism="vmm", handle=..., fd=1 << 31), "fd", "not a file descriptor"),
        ("short handle", legacy(handle="ab" * 63), "handle", "expected 128 hex digits, got 126"),
        ("bad hex", legacy(handle="zz" + "ab" * 63), "handle", "'z' at position 0"),
        ("handle number", legacy(handle=5), "handle", "expected a string"),
        ("negative", legacy(len=-4), "len", "-4 is negative"),
        ("fraction", legacy(offset=1.5), "offset", "not a whole number"),
        ("string number", legacy(alloc_size="4096"), "alloc_size", "found a string"),
        ("too large", legacy(alloc_size=1 << 64), "alloc_size", "too large"),
        ("dtype", legacy(dtype="float32"), "dtype", "is not one of"),
        ("elem_size", legacy(elem_size=8), "elem_size", "does not match dtype u32"),
        ("pid 0", legacy(pid=0), "pid", "not a process id"),
        ("pid too large", legacy(pid=1 << 32), "pid", "not a process id"),
        ("uuid", legacy(device_uuid="GPU-1234"), "device_uuid", "expected GPU-"),
        ("event", legacy(event="00"), "event", "expected 128 hex digits"),
        ("alloc 0", legacy(alloc_size=0, len=4), "alloc_size", "greater than zero"),
        ("len 0", legacy(len=0), "len", "greater than zero"),
        ("len not whole", legacy(len=6), "len", "not a whole number of 4-byte u32"),
        ("offset misaligned", legacy(offset=2), "offset", "not aligned"),
        ("past the end", legacy(offset=(2 << 20) - 4), "len", "passes the end"),
        ("strides alone", legacy(strides=[1]), "strides", "given without shape"),
        ("shape product", legacy(shape=[10, 10]), "shape", "holds 100 elements but len holds 1024"),
        ("strides count", legacy(shape=[1024], strides=[1, 1]), "strides", "2 strides for 1 dimensions"),
        ("strides reach", legacy(shape=[2, 1024], strides=[1024, 1]), "strides", "reaches element 2047"),
        ("shape entry", legacy(shape=[-1]), "shape[0]", "is negative"),
        ("shape type", legacy(shape=5), "shape", "expected an array"),
        ("generation", legacy(generation=-1), "generation", "negative"),
    ]

    def test_each_names_its_field(self):
        for name, d, field, words in self.CASES:
            with self.subTest(name):
                with self.assertRaises(DescriptorError) as cm:
                    validate_descriptor(d)
                self.assertEqual(cm.exception.field, field, str(cm.exception))
                self.assertIn(words, str(cm.exception))
                self.assertIsInstance(cm.exception, ValueError)
                self.assertTrue(str(cm.exception).startswith(f"descriptor field `{field}`"))

    def test_bad_json(self):
        with self.assertRaisesRegex(DescriptorError, "not valid JSON"):
            parse_descriptor("{")


class ArrayInterface(unittest.TestCase):
    def test_contiguous(self):
        d = validate_descriptor(legacy(shape=[32, 32]))
        cai = cuda_array_interface(0x7F0000001000, d)
        self.assertEqual(cai["version"], 3)
        self.assertEqual(cai["shape"], (32, 32))
        self.assertEqual(cai["typestr"], "<u4")
        self.assertEqual(cai["data"], (0x7F0000001000, False))
        self.assertIsNone(cai["strides"])
        self.assertIn("stream", cai)
        self.assertIsNone(cai["stream"])
        self.assertEqual(cai["descr"], [("", "<u4")])

    def test_strides_in_bytes_and_no_shape(self):
        d = validate_descriptor(legacy(len=240, shape=[5, 3], strides=[1, 5], dtype="f64", elem_size=8))
        cai = cuda_array_interface(4096, d, stream=1)
        self.assertEqual(cai["strides"], (8, 40))
        self.assertEqual(cai["stream"], 1)
        flat = cuda_array_interface(4096, validate_descriptor(legacy()))
        self.assertEqual(flat["shape"], (1024,))

    def test_raw_types(self):
        d = validate_descriptor(legacy(dtype="bf16", elem_size=2))
        self.assertEqual(cuda_array_interface(0, d)["typestr"], "<V2")
        self.assertEqual(cuda_array_interface(0, d, raw=True)["typestr"], "<i2")

    def test_stream_zero_is_refused(self):
        with self.assertRaises(ValueError):
            cuda_array_interface(0, validate_descriptor(legacy()), stream=0)


class DtypeTables(unittest.TestCase):
    def test_tables_agree(self):
        self.assertEqual(len(dtypes.DTYPES), 21)
        for dt in dtypes.DTYPES:
            self.assertIs(dtypes.by_name(dt.name), dt)
            self.assertIs(dtypes.from_torch(dt.torch), dt)
            self.assertIs(dtypes.from_numpy_name(dt.numpy), dt)
            self.assertIs(dtypes.lookup(dt.torch), dt)
            self.assertIs(dtypes.lookup("torch." + dt.torch), dt)
            self.assertEqual(int(dt.raw_typestr[2:]), dt.size)
            self.assertEqual(int(dt.typestr[2:]), dt.size)

    def test_torch_names(self):
        expected = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
                    "int8": "i8", "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64",
                    "bool": "bool", "uint16": "u16", "uint32": "u32", "uint64": "u64",
                    "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "float8_e4m3fnuz": "f8e4m3fnuz",
                    "float8_e5m2fnuz": "f8e5m2fnuz", "float8_e8m0fnu": "f8e8m0fnu",
                    "float4_e2m1fn_x2": "f4e2m1fnx2", "complex64": "c64", "complex128": "c128"}
        for torch_name, ours in expected.items():
            self.assertEqual(dtypes.from_torch(torch_name).name, ours)
        self.assertEqual(len(expected), len(dtypes.DTYPES))
        for bad in ("complex32", "uint4", "qint8"):
            self.assertIsNone(dtypes.from_torch(bad))


class ImportIsLight(unittest.TestCase):
    def test_no_heavy_imports(self):
        import subprocess

        code = ("import sys; sys.path.insert(0, %r); import cuda_ipc; "
                "print(sorted(m for m in ('torch', 'cupy', 'numpy') if m in sys.modules))") % _path.PACKAGE_PARENT
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        self.assertEqual(out.stdout.strip(), "[]")

    def test_public_names(self):
        for name in cuda_ipc.__all__:
            self.assertTrue(hasattr(cuda_ipc, name), name)


if __name__ == "__main__":
    unittest.main()
