"""Descriptors: the language-neutral JSON record of one export.

The same format and the same rules as the Rust ``cuda_ipc::descriptor``
(format 1)::

    {"cuda_ipc": 1, "mechanism": "legacy", "handle": "<128 hex digits>",
     "alloc_size": 2097152, "offset": 0, "len": 4096, "dtype": "u32",
     "elem_size": 4, "shape": [1024], "device_uuid": "GPU-...", "pid": 4242,
     "event": "<128 hex digits>"}

:func:`validate_descriptor` checks a descriptor strictly (unknown fields,
wrong types, negative or fractional numbers, inconsistent sizes and fields
that do not belong to the mechanism are errors naming the field) and returns
it normalised. Nothing here needs a GPU.
"""

import json
import re

from . import dtypes as _dtypes
from .errors import DescriptorError

__all__ = [
    "FORMAT_VERSION",
    "VERSION_KEY",
    "MECHANISMS",
    "validate_descriptor",
    "parse_descriptor",
    "cuda_array_interface",
    "descriptor_elements",
]

FORMAT_VERSION = 1
VERSION_KEY = "cuda_ipc"
MECHANISMS = ("legacy", "vmm", "pool", "fabric")
HANDLE_HEX = 128

_FIELDS = (
    VERSION_KEY, "mechanism", "handle", "fd", "alloc_size", "offset", "len", "dtype",
    "elem_size", "shape", "strides", "device_uuid", "pid", "event", "generation",
)
_U64_MAX = (1 << 64) - 1
_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


def _kind(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, tuple)):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _u64(field, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise DescriptorError(field, f"expected a non-negative whole number, found {_kind(v)}")
    if isinstance(v, float):
        raise DescriptorError(field, f"{v} is not a whole number")
    if v < 0:
        raise DescriptorError(field, f"{v} is negative")
    if v > _U64_MAX:
        raise DescriptorError(field, f"{v} is too large")
    return int(v)


def _str(field, v):
    if not isinstance(v, str):
        raise DescriptorError(field, f"expected a string, found {_kind(v)}")
    return v


def _hex_handle(field, v, what):
    s = _str(field, v)
    for i, c in enumerate(s):
        if c not in "0123456789abcdefABCDEF":
            raise DescriptorError(
                field,
                f"invalid {what}: character {c!r} at position {i} is not a hex digit "
                f"(expected {HANDLE_HEX} hex digits)",
            )
    if len(s) != HANDLE_HEX:
        raise DescriptorError(field, f"invalid {what}: expected {HANDLE_HEX} hex digits, got {len(s)}")
    return s.lower()


def _u64_list(field, v):
    if not isinstance(v, (list, tuple)):
        raise DescriptorError(field, f"expected an array of whole numbers, found {_kind(v)}")
    return [_u64(f"{field}[{i}]", x) for i, x in enumerate(v)]


def parse_descriptor(descriptor):
    """A descriptor from a dict, a JSON string or bytes, validated."""
    if isinstance(descriptor, (bytes, bytearray)):
        descriptor = descriptor.decode("utf-8", errors="replace")
    if isinstance(descriptor, str):
        try:
            descriptor = json.loads(descriptor)
        except ValueError as e:
            raise DescriptorError("(document)", f"not valid JSON: {e}") from None
    return validate_descriptor(descriptor)


def validate_descriptor(d):
    """Checks a descriptor (a dict) and returns a normalised copy: absent and
    null optional fields are removed, hex is lower-case, ``elem_size`` is
    filled in. Raises :class:`DescriptorError` naming the first bad field."""
    if not isinstance(d, dict):
        raise DescriptorError("(document)", f"expected a JSON object, found {_kind(d)}")
    for k in d:
        if k not in _FIELDS:
            raise DescriptorError(k, f"unknown field (this reader knows format {FORMAT_VERSION})")
    get = {k: v for k, v in d.items() if v is not None}

    def required(k):
        if k not in get:
            raise DescriptorError(k, "missing")
        return get[k]

    version = _u64(VERSION_KEY, required(VERSION_KEY))
    if version != FORMAT_VERSION:
        raise DescriptorError(
            VERSION_KEY,
            f"format {version} is not supported; this build reads format {FORMAT_VERSION}",
        )
    mechanism = _str("mechanism", required("mechanism"))
    if mechanism not in MECHANISMS:
        raise DescriptorError("mechanism", f"{mechanism!r} is not one of legacy, vmm, pool, fabric")
    out = {VERSION_KEY: FORMAT_VERSION, "mechanism": mechanism}

    def forbid(k):
        if k in get:
            raise DescriptorError(k, f"does not belong to a {mechanism} descriptor")

    def fd():
        n = _u64("fd", required("fd"))
        if n > 0x7FFFFFFF:
            raise DescriptorError("fd", f"{n} is not a file descriptor number")
        return n

    if mechanism == "legacy":
        forbid("fd")
        out["handle"] = _hex_handle("handle", required("handle"), "IPC memory handle")
    elif mechanism == "fabric":
        forbid("fd")
        out["handle"] = _hex_handle("handle", required("handle"), "fabric handle")
    elif mechanism == "vmm":
        forbid("handle")
        out["fd"] = fd()
    else:
        out["fd"] = fd()
        out["handle"] = _hex_handle("handle", required("handle"), "memory-pool pointer export data")

    dtype_name = _str("dtype", required("dtype"))
    dt = _dtypes.by_name(dtype_name)
    if dt is None:
        raise DescriptorError("dtype", f"{dtype_name!r} is not one of {', '.join(_dtypes.names())}")
    if "elem_size" in get:
        n = _u64("elem_size", get["elem_size"])
        if n != dt.size:
            raise DescriptorError("elem_size", f"{n} does not match dtype {dt.name} ({dt.size} bytes)")
    pid = _u64("pid", required("pid"))
    if pid == 0 or pid > 0xFFFFFFFF:
        raise DescriptorError("pid", f"{pid} is not a process id")
    if "event" in get:
        out["event"] = _hex_handle("event", get["event"], "IPC event handle")
    if "generation" in get:
        out["generation"] = _u64("generation", get["generation"])
    out["alloc_size"] = _u64("alloc_size", required("alloc_size"))
    out["offset"] = _u64("offset", required("offset"))
    out["len"] = _u64("len", required("len"))
    out["dtype"] = dt.name
    out["elem_size"] = dt.size
    if "shape" in get:
        out["shape"] = _u64_list("shape", get["shape"])
    if "strides" in get:
        out["strides"] = _u64_list("strides", get["strides"])
    uuid = _str("device_uuid", required("device_uuid"))
    if not _UUID.match(uuid):
        raise DescriptorError(
            "device_uuid",
            f"invalid device UUID: {uuid!r}; expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
        )
    out["device_uuid"] = "GPU-" + uuid[4:].lower()
    out["pid"] = pid
    _check_sizes(out, dt)
    return out


def _check_sizes(d, dt):
    elem = dt.size
    alloc, off, length = d["alloc_size"], d["offset"], d["len"]
    if alloc == 0:
        raise DescriptorError("alloc_size", "must be greater than zero")
    if length == 0:
        raise DescriptorError("len", "must be greater than zero")
    if length % elem:
        raise DescriptorError("len", f"{length} is not a whole number of {elem}-byte {dt.name} elements")
    if off % elem:
        raise DescriptorError("offset", f"{off} is not aligned to the {elem}-byte {dt.name} elements")
    if off + length > alloc or off + length > _U64_MAX:
        raise DescriptorError(
            "len", f"offset {off} + len {length} passes the end of the {alloc}-byte allocation"
        )
    shape, strides = d.get("shape"), d.get("strides")
    if shape is None:
        if strides is not None:
            raise DescriptorError("strides", "given without shape")
        return
    count = length // elem
    if strides is None:
        product = 1
        for x in shape:
            product *= x
        if product > _U64_MAX:
            raise DescriptorError("shape", "the product of the dimensions overflows")
        if product != count:
            raise DescriptorError("shape", f"{shape} holds {product} elements but len holds {count}")
        return
    if len(strides) != len(shape):
        raise DescriptorError("strides", f"{len(strides)} strides for {len(shape)} dimensions")
    if 0 not in shape:
        last = sum((n - 1) * s for n, s in zip(shape, strides))
        if last > _U64_MAX:
            raise DescriptorError("strides", "the extent overflows")
        if last >= count:
            raise DescriptorError(
                "strides",
                f"shape {shape} with strides {strides} reaches element {last}, past the {count} exported",
            )


def descriptor_elements(d):
    """Number of elements in the exported bytes."""
    return d["len"] // d["elem_size"]


def cuda_array_interface(ptr, d, stream=None, raw=False):
    """The ``__cuda_array_interface__`` (version 3) of the exported bytes of
    descriptor ``d`` (validated) mapped at device address ``ptr`` (the first
    exported byte, offset already applied).

    ``stream`` is the CUDA array interface ``stream`` value: ``None`` when the
    consumer need not synchronise, else a stream handle (``1`` for the legacy
    default stream). With ``raw``, the type string is a same-sized type every
    consumer can build (``<i2`` for bf16 and u16, ...), for reinterpretation.
    """
    dt = _dtypes.by_name(d["dtype"])
    typestr = dt.raw_typestr if raw else dt.typestr
    shape = d.get("shape")
    if shape is None:
        shape = [d["len"] // dt.size]
    strides = d.get("strides")
    cai = {
        "version": 3,
        "shape": tuple(int(x) for x in shape),
        "typestr": typestr,
        "descr": [("", typestr)],
        "data": (int(ptr), False),
        "strides": None if strides is None else tuple(int(s) * dt.size for s in strides),
        "stream": stream,
    }
    if stream == 0:
        raise ValueError("the CUDA array interface forbids stream 0; use 1 for the legacy default stream")
    return cai
