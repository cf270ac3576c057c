"""Writes crates/cuda-ipc/tests/data/torch/cases.json: PyTorch share records
(as `cuda_ipc.torch_share_record` writes them) and what each must become.

The Rust tests (crates/cuda-ipc/tests/torch.rs) and the Python tests
(python/tests/test_torch_records.py) both check every case, so the two
converters cannot drift apart. Expected values are computed here by hand,
independently of either converter. Run from the repository root:

    python3 python/tests/make_torch_fixtures.py
"""

import json
import os
import random
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "crates", "cuda-ipc", "tests", "data", "torch", "cases.json")

UUID = "GPU-5e2c7a1f-03b4-4c6d-9e8f-0a1b2c3d4e5f"
PID = 4242
MIB = 1 << 20

rng = random.Random(20261129)


def rbytes(n):
    return bytes(rng.randrange(256) for _ in range(n))


# A cudaIpcMemHandle and an event handle as a driver might issue them
# (opaque; only "not all zero" matters).
MEM = rbytes(64)
MEM2 = rbytes(64)
EVENT = rbytes(64)
FABRIC = rbytes(64)
REFCOUNTER = b"/torch_4242_1871234567_0"


def c_handle(version=2, mem=MEM):
    return bytes([version]) + b"c" + mem


def e_handle(version=2, pid=PID, segment=2 * MIB, fds=(37,), fabric=None, pad=b"\0" * 4, count=None):
    handles = fabric if fabric is not None else list(fds)
    n = len(handles) if count is None else count
    head = struct.pack("<i", pid) + pad + struct.pack("<QQ", segment, n)
    if version >= 3:
        head += struct.pack("<i", 2 if fabric is not None else 1) + b"\0" * 4
    body = b"".join(fabric) if fabric is not None else b"".join(struct.pack("<i", f) for f in fds)
    return bytes([version]) + b"e" + head + body


def record(handle, size, stride, dtype, storage_size, storage_offset=0, tensor_offset=0, event=True, **extra):
    r = {
        "torch_share": 1,
        "storage_handle": handle.hex(),
        "storage_size_bytes": storage_size,
        "storage_offset_bytes": storage_offset,
        "tensor_size": list(size),
        "tensor_stride": list(stride),
        "tensor_offset": tensor_offset,
        "dtype": dtype,
        "storage_device": 0,
        "device_uuid": UUID,
        "pid": PID,
        "requires_grad": False,
        "ref_counter_handle": REFCOUNTER.hex(),
        "ref_counter_offset": 3,
        "event_handle": EVENT.hex(),
        "event_sync_required": event,
    }
    r.update(extra)
    return r


def desc(mechanism, alloc_size, offset, length, dtype, elem, shape, strides=None, event=True, **source):
    d = {"cuda_ipc": 1, "mechanism": mechanism, "alloc_size": alloc_size, "offset": offset,
         "len": length, "dtype": dtype, "elem_size": elem, "shape": list(shape),
         "device_uuid": UUID, "pid": PID}
    d.update(source)
    if strides is not None:
        d["strides"] = list(strides)
    if event:
        d["event"] = EVENT.hex()
    return d


cases = []


def ok(name, rec, expected):
    cases.append({"name": name, "record": rec, "descriptor": expected})


def bad(name, rec, error):
    cases.append({"name": name, "record": rec, "error": error})


# --- records that convert ---------------------------------------------------
# A whole contiguous 4x8 float32 tensor, PyTorch 2.11 ('c', version 2).
ok("c_v2_contiguous_float32",
   record(c_handle(2), [4, 8], [8, 1], "float32", 128),
   desc("legacy", 128, 0, 128, "f32", 4, [4, 8], handle=MEM.hex()))
# x = torch.empty(1024, float16) at byte 2048 of a 2 MiB block; t = x[100:300].
# offset = 2048 + 100 * 2 = 2248; len = 200 * 2 = 400. PyTorch 2.13 ('c', version 3).
ok("c_v3_slice_float16_at_offset",
   record(c_handle(3), [200], [1], "float16", 2048, storage_offset=2048, tensor_offset=100,
          alloc_size=2 * MIB),
   desc("legacy", 2 * MIB, 2248, 400, "f16", 2, [200], handle=MEM.hex()))
# y = torch.empty(3, 5, int32).t(): size [5, 3], stride [1, 5];
# extent 1 + 4*1 + 2*5 = 15 elements = 60 bytes; strides carried.
ok("c_v2_transposed_int32",
   record(c_handle(2), [5, 3], [1, 5], "int32", 60, storage_offset=512),
   desc("legacy", 572, 512, 60, "i32", 4, [5, 3], strides=[1, 5], handle=MEM.hex()))
# A 4-D bfloat16 tensor, contiguous: 120 elements, 240 bytes.
ok("c_v2_4d_bfloat16",
   record(c_handle(2, MEM2), [2, 3, 4, 5], [60, 20, 5, 1], "bfloat16", 240, event=False),
   desc("legacy", 240, 0, 240, "bf16", 2, [2, 3, 4, 5], event=False, handle=MEM2.hex()))
# Every 2nd row of a 6x4 float64: z = w[::2]: size [3, 4], stride [8, 1],
# tensor_offset 4 (w[1::2]); extent 1 + 2*8 + 3 = 20 elements = 160 bytes at 32.
ok("c_v2_strided_rows_float64",
   record(c_handle(2), [3, 4], [8, 1], "float64", 192, tensor_offset=4),
   desc("legacy", 192, 32, 160, "f64", 8, [3, 4], strides=[8, 1], handle=MEM.hex()))
# A 0-d int64 tensor (a scalar): one element.
ok("c_v2_scalar_int64",
   record(c_handle(2), [], [], "int64", 64, tensor_offset=7),
   desc("legacy", 64, 56, 8, "i64", 8, [], handle=MEM.hex()))
# A bool column vector with a size-1 dimension whose stride is arbitrary
# (PyTorch often reports odd strides for size-1 dims): still contiguous.
ok("c_v2_bool_size_one_dim",
   record(c_handle(2), [16, 1], [1, 99], "bool", 32, tensor_offset=16),
   desc("legacy", 32, 16, 16, "bool", 1, [16, 1], handle=MEM.hex()))
# The fp8, fp4 (two values a byte) and complex types travel under their names.
for torch_name, ours, size in [("uint8", "u8", 1), ("int8", "i8", 1), ("int16", "i16", 2),
                               ("uint16", "u16", 2), ("uint32", "u32", 4), ("uint64", "u64", 8),
                               ("float8_e4m3fn", "f8e4m3fn", 1), ("float8_e5m2", "f8e5m2", 1),
                               ("float8_e4m3fnuz", "f8e4m3fnuz", 1), ("float8_e5m2fnuz", "f8e5m2fnuz", 1),
                               ("float8_e8m0fnu", "f8e8m0fnu", 1), ("float4_e2m1fn_x2", "f4e2m1fnx2", 1),
                               ("complex64", "c64", 8), ("complex128", "c128", 16)]:
    ok(f"c_v2_dtype_{torch_name}",
       record(c_handle(2), [10], [1], torch_name, 10 * size, event=False),
       desc("legacy", 10 * size, 0, 10 * size, ours, size, [10], event=False, handle=MEM.hex()))
# Expandable segment, one 2 MiB allocation shared as fd 37 (PyTorch 2.11):
# a vmm descriptor; the tensor's 256 uint8 start 512 bytes into the segment.
ok("e_v2_one_fd_uint8",
   record(e_handle(2, fds=[37]), [256], [1], "uint8", 1024, storage_offset=512),
   desc("vmm", 2 * MIB, 512, 256, "u8", 1, [256], fd=37))
# The same in the version 3 layout (32-byte header with the handle type).
ok("e_v3_one_fd_float32",
   record(e_handle(3, segment=20 * MIB, fds=[5]), [64, 64], [64, 1], "float32", 16384,
          storage_offset=4 * MIB, tensor_offset=0),
   desc("vmm", 20 * MIB, 4 * MIB, 16384, "f32", 4, [64, 64], fd=5))
# Older PyTorch left the 4 bytes after the pid uninitialised: ignored.
ok("e_v2_uninitialised_padding",
   record(e_handle(2, fds=[9], pad=b"\xde\xad\xbe\xef"), [16], [1], "int64", 128),
   desc("vmm", 2 * MIB, 0, 128, "i64", 8, [16], fd=9))
# One allocation shared as a fabric handle.
ok("e_v2_one_fabric_handle",
   record(e_handle(2, fabric=[FABRIC]), [8], [1], "int32", 32),
   desc("fabric", 2 * MIB, 0, 32, "i32", 4, [8], handle=FABRIC.hex()))

# --- records that must be refused ---------------------------------------------
base = record(c_handle(2), [4], [1], "float32", 16)


def variant(**changes):
    r = dict(base)
    for k, v in changes.items():
        if v is None:
            r.pop(k, None)
        else:
            r[k] = v
    return r


bad("handle_version_4", variant(storage_handle=(bytes([4]) + b"c" + MEM).hex()), "version 4")
bad("handle_version_1", variant(storage_handle=(bytes([1]) + b"c" + MEM).hex()), "version 1")
bad("handle_type_x", variant(storage_handle=(bytes([2]) + b"x" + MEM).hex()), "type byte 0x78 ('x')")
bad("handle_type_x_names_version", variant(storage_handle=(bytes([2]) + b"x" + MEM).hex()), "version 2")
bad("handle_truncated_1_byte", variant(storage_handle="02"), "1 byte(s) long")
bad("handle_c_truncated", variant(storage_handle=c_handle(2)[:-1].hex()), "65 bytes long")
bad("handle_c_too_long", variant(storage_handle=(c_handle(2) + b"\0").hex()), "67 bytes long")
bad("handle_c_all_zero", variant(storage_handle=c_handle(2, bytes(64)).hex()), "all-zero")
bad("handle_bad_hex", variant(storage_handle="02zz" + MEM.hex()), "not a hex digit")
bad("handle_odd_hex", variant(storage_handle=c_handle(2).hex()[:-1]), "whole number of bytes")
bad("handle_not_string", variant(storage_handle=12), "expected a hex string")
bad("handle_missing", variant(storage_handle=None), "`storage_handle`: missing")
bad("handle_empty", variant(storage_handle=""), "`storage_handle`: empty")
bad("e_short_header", variant(storage_handle=e_handle(2)[:20].hex()), "shorter than the 24-byte")
bad("e_truncated_fds", variant(storage_handle=e_handle(2, fds=[3, 4])[:-2].hex()), "not a whole number")
bad("e_count_mismatch", variant(storage_handle=e_handle(2, fds=[3, 4], count=3).hex()), "header says 3 segment(s)")
bad("e_zero_segments", variant(storage_handle=e_handle(2, fds=[], count=0).hex()), "no segments")
bad("e_negative_fd", variant(storage_handle=e_handle(2, fds=[-1]).hex()), "is -1")
bad("e_bad_pid", variant(storage_handle=e_handle(2, pid=0).hex()), "pid 0")
bad("e_zero_segment_size", variant(storage_handle=e_handle(2, segment=0).hex()), "segment size 0")
bad("e_pid_mismatch", variant(storage_handle=e_handle(2, pid=777).hex()), "process 777")
bad("e_several_fds", variant(storage_handle=e_handle(2, fds=[3, 4, 5]).hex()), "3 POSIX file descriptors")
bad("e_v3_several_fabric", variant(storage_handle=e_handle(3, fabric=[FABRIC, FABRIC]).hex()), "2 fabric handles")
bad("e_storage_past_segment", variant(storage_handle=e_handle(2).hex(), storage_offset_bytes=2 * MIB),
    "shares 2097152 bytes")
bad("negative_storage_size", variant(storage_size_bytes=-1), "`storage_size_bytes`: -1 is negative")
bad("fractional_storage_offset", variant(storage_offset_bytes=1.5), "not a whole number")
bad("string_tensor_offset", variant(tensor_offset="0"), "found a string")
bad("negative_size", variant(tensor_size=[-4]), "`tensor_size[0]`: -4 is negative")
bad("shape_stride_mismatch", variant(tensor_size=[2, 2], tensor_stride=[1]), "1 strides for the 2 dimensions")
bad("negative_stride", variant(tensor_size=[2, 2], tensor_stride=[-2, 1]), "negative")
bad("overlapping_stride_broadcast", variant(tensor_size=[3, 4], tensor_stride=[0, 1]), "overlapping")
bad("overlapping_stride_partial", variant(tensor_size=[2, 3], tensor_stride=[2, 1]), "overlapping")
bad("empty_tensor", variant(tensor_size=[0, 4], tensor_stride=[4, 1]), "holds no elements")
bad("tensor_past_storage", variant(tensor_offset=1), "the storage has 16 bytes")
bad("unknown_dtype", variant(dtype="complex32"), "\"complex32\" cannot be shared")
bad("prefixed_dtype", variant(dtype="torch.float32"), "without the torch. prefix")
# Sub-byte types have no element type of their own: their bytes travel as uint8.
bad("sub_byte_dtype", variant(dtype="uint4"), "view the tensor as uint8 first (t.view(torch.uint8))")
bad("unknown_field", variant(colour="blue"), "`colour`: unknown field")
bad("descriptor_not_record", dict(variant(), cuda_ipc=1), "not a PyTorch share record")
bad("record_format_2", variant(torch_share=2), "record format 2")
bad("missing_format", variant(torch_share=None), "`torch_share`: missing")
bad("missing_dtype", variant(dtype=None), "`dtype`: missing")
bad("pid_zero", variant(pid=0), "0 is not a process id")
bad("bad_uuid", variant(device_uuid="GPU-1234"), "`device_uuid`")
bad("event_required_but_missing", variant(event_handle=None, event_sync_required=True), "event_sync_required is true")
bad("event_handle_short", variant(event_handle="00" * 63), "`event_handle`")
bad("event_sync_not_bool", variant(event_sync_required=1), "expected true or false")
bad("alloc_size_too_small", variant(alloc_size=8), "`alloc_size`: 8 bytes")
bad("not_an_object", [1, 2, 3], "expected a JSON object")

with open(OUT, "w") as f:
    json.dump({"comment": "Generated by python/tests/make_torch_fixtures.py; both the Rust and "
                          "the Python converter must agree with every case.",
               "cases": cases}, f, indent=1, sort_keys=True)
    f.write("\n")
print(f"{len(cases)} cases -> {os.path.relpath(OUT, ROOT)}")
