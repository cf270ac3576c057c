"""PyTorch share records: what ``reduce_tensor`` gives for a CUDA tensor, as
language-neutral JSON, and their conversion to descriptors.

The same format and rules as the Rust ``cuda_ipc::torch`` (record format 1)::

    {"torch_share": 1, "storage_handle": "02 63 <64-byte handle> (hex)",
     "storage_size_bytes": 4096, "storage_offset_bytes": 1024,
     "tensor_size": [4, 8], "tensor_stride": [8, 1], "tensor_offset": 16,
     "dtype": "float32", "storage_device": 0, "device_uuid": "GPU-...",
     "pid": 4242, "requires_grad": false, "ref_counter_handle": "<hex>",
     "ref_counter_offset": 0, "event_handle": "<hex>",
     "event_sync_required": true, "alloc_size": 2097152}

The storage handle (``storage._share_cuda_()``) is a version byte (2 up to
PyTorch 2.12, 3 from 2.13), a type byte and a payload:

- ``'c'``: a block of a ``cudaMalloc`` allocation; 64-byte
  ``cudaIpcMemHandle_t`` follows (66 bytes in all);
- ``'e'``: a range of an expandable segment: a header ``{pid: i32, 4 bytes
  padding, segment_size: u64, num_handles: u64}`` (version 3 adds ``handle
  type: i32`` and 4 bytes of padding, as this package reads it) and one
  handle per physical allocation: a 4-byte POSIX file descriptor number in
  the exporter, or a 64-byte fabric handle.

Nothing here needs a GPU or PyTorch.
"""

import json
import re
import struct

from . import dtypes as _dtypes
from .descriptor import validate_descriptor
from .errors import TorchRecordError

__all__ = [
    "RECORD_FORMAT",
    "RECORD_KEY",
    "parse_storage_handle",
    "validate_record",
    "tensor_layout",
    "record_to_descriptor",
    "is_record",
]

RECORD_FORMAT = 1
RECORD_KEY = "torch_share"
HANDLE_VERSIONS = (2, 3)
HANDLE_LEN = 64
SEGMENT_HEADER_V2 = 24
SEGMENT_HEADER_V3 = 32

_FIELDS = (
    RECORD_KEY, "storage_handle", "storage_size_bytes", "storage_offset_bytes", "tensor_size",
    "tensor_stride", "tensor_offset", "dtype", "storage_device", "device_uuid", "pid",
    "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
    "event_sync_required", "alloc_size",
)
_U64_MAX = (1 << 64) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


def is_record(obj):
    """Whether a dict is a PyTorch share record (rather than a descriptor)."""
    return isinstance(obj, dict) and RECORD_KEY in obj


def _err(reason):
    return TorchRecordError(reason)


def _field(field, reason):
    return TorchRecordError(f"field `{field}`: {reason}")


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


def _describe_type(t):
    c = chr(t)
    if 0x21 <= t <= 0x7E:
        return f"0x{t:02x} ({c!r})"
    return f"0x{t:02x}"


# --- storage handles ---------------------------------------------------------


def parse_storage_handle(data):
    """Parses a storage handle (bytes). Returns a dict:

    - ``{"type": "c", "version": v, "handle": bytes64}``
    - ``{"type": "e", "version": v, "pid": int, "segment_size": int,
      "kind": "fd" | "fabric", "handles": [int fd, ...] | [bytes64, ...]}``

    Raises :class:`TorchRecordError` naming the version and type byte for
    anything else.
    """
    data = bytes(data)
    if len(data) < 2:
        raise _err(
            f"storage handle is {len(data)} byte(s) long; a handle starts with a version byte "
            "and a type byte"
        )
    version, kind = data[0], data[1]
    if version not in HANDLE_VERSIONS:
        raise _err(
            f"storage handle version {version} (type byte {_describe_type(kind)}) is not "
            "supported: this build reads versions 2 (PyTorch up to 2.12) and 3 (PyTorch 2.13)"
        )
    payload = data[2:]
    if kind == ord("c"):
        if len(data) != 2 + HANDLE_LEN:
            raise _err(
                f"storage handle of version {version}, type 'c' (cudaMalloc block) is "
                f"{len(data)} bytes long; it must be {2 + HANDLE_LEN} (2 + a {HANDLE_LEN}-byte "
                "cudaIpcMemHandle)"
            )
        if not any(payload):
            raise _err(
                "storage handle of type 'c' holds an all-zero cudaIpcMemHandle, which no driver issues"
            )
        return {"type": "c", "version": version, "handle": payload}
    if kind == ord("e"):
        return _parse_segment(version, payload)
    raise _err(
        f"storage handle of version {version} has type byte {_describe_type(kind)}: this build "
        "reads 'c' (cudaMalloc block) and 'e' (expandable segment)"
    )


def _parse_segment(version, p):
    if len(p) < SEGMENT_HEADER_V2:
        raise _err(
            f"storage handle of version {version}, type 'e' (expandable segment) has a "
            f"{len(p)}-byte payload, shorter than the {SEGMENT_HEADER_V2}-byte segment header"
        )
    (pid,) = struct.unpack_from("=i", p, 0)
    # Bytes 4..8 are padding: older PyTorch left them uninitialised (before
    # pytorch/pytorch#161885), and 2.13 may again (pytorch/pytorch#198305), so
    # they are not checked.
    segment_size, count = struct.unpack_from("=QQ", p, 8)
    describe = (
        f"storage handle of version {version}, type 'e' (expandable segment): header says "
        f"{count} segment(s) of {segment_size} bytes, and {len(p) - SEGMENT_HEADER_V2} payload "
        f"bytes follow the {SEGMENT_HEADER_V2}-byte header"
    )
    sizes = {"fd": 4, "fabric": HANDLE_LEN}
    layout = None
    if version >= 3 and len(p) >= SEGMENT_HEADER_V3:
        (t,) = struct.unpack_from("=i", p, 24)
        kind = {1: "fd", 2: "fabric"}.get(t)
        if kind and count * sizes[kind] == len(p) - SEGMENT_HEADER_V3:
            layout = (SEGMENT_HEADER_V3, kind)
    if layout is None:
        rest = len(p) - SEGMENT_HEADER_V2
        for kind in ("fd", "fabric"):
            if count * sizes[kind] == rest:
                layout = (SEGMENT_HEADER_V2, kind)
                break
    if layout is None:
        raise _err(
            f"{describe}: that is not a whole number of 4-byte file descriptors or 64-byte "
            "fabric handles for the stated count (a truncated or foreign handle)"
        )
    if count == 0:
        raise _err(f"{describe}: no segments to map")
    if pid <= 0:
        raise _err(f"{describe}: the exporter's pid {pid} is not a process id")
    if segment_size == 0:
        raise _err(f"{describe}: segment size 0")
    if segment_size * count > _U64_MAX:
        raise _err(f"{describe}: the shared range overflows")
    header, kind = layout
    body = p[header:]
    if kind == "fd":
        fds = [struct.unpack_from("=i", body, 4 * i)[0] for i in range(count)]
        for i, fd in enumerate(fds):
            if fd < 0:
                raise _err(f"{describe}: file descriptor {i} is {fd}, not a descriptor number")
        handles = fds
    else:
        handles = [body[64 * i: 64 * (i + 1)] for i in range(count)]
    return {"type": "e", "version": version, "pid": pid, "segment_size": segment_size,
            "kind": kind, "handles": handles}


# --- records -------------------------------------------------------------------


def _u64(field, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _field(field, f"expected a non-negative whole number, found {_kind(v)}")
    if isinstance(v, float):
        raise _field(field, f"{v} is not a whole number")
    if v < 0:
        raise _field(field, f"{v} is negative")
    if v > _U64_MAX:
        raise _field(field, f"{v} is too large")
    return int(v)


def _hex(field, v):
    if not isinstance(v, str):
        raise _field(field, f"expected a hex string, found {_kind(v)}")
    for i, c in enumerate(v):
        if c not in "0123456789abcdefABCDEF":
            raise _field(field, f"character {c!r} at position {i} is not a hex digit")
    if len(v) % 2:
        raise _field(field, f"{len(v)} hex digits is not a whole number of bytes")
    return bytes.fromhex(v)


def validate_record(record):
    """Checks a record (dict, or JSON text) and returns a normalised copy with
    ``storage_handle``, ``event_handle`` and ``ref_counter_handle`` as bytes.
    Raises :class:`TorchRecordError` naming the first bad field."""
    if isinstance(record, (str, bytes, bytearray)):
        try:
            record = json.loads(record)
        except ValueError as e:
            raise _field("(document)", f"not valid JSON: {e}") from None
    if not isinstance(record, dict):
        raise _field("(document)", f"expected a JSON object, found {_kind(record)}")
    for k in record:
        if k not in _FIELDS:
            hint = " (this is a cuda-ipc descriptor, not a PyTorch share record)" if k == "cuda_ipc" else ""
            raise _field(k, f"unknown field (this reader knows record format {RECORD_FORMAT}){hint}")
    get = {k: v for k, v in record.items() if v is not None}

    def required(k):
        if k not in get:
            raise _field(k, "missing")
        return get[k]

    fmt = _u64(RECORD_KEY, required(RECORD_KEY))
    if fmt != RECORD_FORMAT:
        raise _field(
            RECORD_KEY,
            f"record format {fmt} is not supported; this build reads format {RECORD_FORMAT}",
        )

    def array(k):
        v = required(k)
        if not isinstance(v, (list, tuple)):
            raise _field(k, f"expected an array of whole numbers, found {_kind(v)}")
        return v

    size = [_u64(f"tensor_size[{i}]", x) for i, x in enumerate(array("tensor_size"))]
    stride = []
    for i, x in enumerate(array("tensor_stride")):
        k = f"tensor_stride[{i}]"
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise _field(k, f"expected a whole number, found {_kind(x)}")
        if isinstance(x, float):
            raise _field(k, f"{x} is not a whole number")
        if not _I64_MIN <= x <= _I64_MAX:
            raise _field(k, f"{x} is too large")
        stride.append(int(x))
    if len(stride) != len(size):
        raise _field(
            "tensor_stride",
            f"{len(stride)} strides for the {len(size)} dimensions of tensor_size",
        )
    dtype_name = required("dtype")
    if not isinstance(dtype_name, str):
        raise _field("dtype", f"expected a string, found {_kind(dtype_name)}")
    if _dtypes.from_torch(dtype_name) is None:
        known = ", ".join(d.torch for d in _dtypes.DTYPES)
        hint = ""
        if dtype_name.startswith("torch."):
            hint = f" (write {json.dumps(dtype_name[6:])}, without the torch. prefix)"
        raise _field("dtype", f"dtype {json.dumps(dtype_name)} cannot be shared{hint}: the "
                              f"element types that can are {known}")
    pid = _u64("pid", required("pid"))
    if pid > 0xFFFFFFFF:
        raise _field("pid", f"{pid} is too large")
    if pid == 0:
        raise _field("pid", "0 is not a process id")
    uuid = required("device_uuid")
    if not isinstance(uuid, str):
        raise _field("device_uuid", f"expected a string, found {_kind(uuid)}")
    if not _UUID.match(uuid):
        raise _field(
            "device_uuid",
            f"invalid device UUID: {uuid!r}; expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
        )
    event = None
    if "event_handle" in get:
        event = _hex("event_handle", get["event_handle"])
        if len(event) != HANDLE_LEN:
            raise _field("event_handle", f"invalid IPC event handle: expected {HANDLE_LEN} bytes, got {len(event)}")

    def boolean(k, default=False):
        v = get.get(k, default)
        if not isinstance(v, bool):
            raise _field(k, f"expected true or false, found {_kind(v)}")
        return v

    sync = boolean("event_sync_required")
    if sync and event is None:
        raise _field("event_handle", "missing, but event_sync_required is true")
    handle = _hex("storage_handle", required("storage_handle"))
    if not handle:
        raise _field("storage_handle", "empty")
    out = {
        RECORD_KEY: RECORD_FORMAT,
        "storage_handle": handle,
        "storage_size_bytes": _u64("storage_size_bytes", required("storage_size_bytes")),
        "storage_offset_bytes": _u64("storage_offset_bytes", required("storage_offset_bytes")),
        "tensor_size": size,
        "tensor_stride": stride,
        "tensor_offset": _u64("tensor_offset", required("tensor_offset")),
        "dtype": dtype_name,
        "storage_device": _u64("storage_device", required("storage_device")),
        "device_uuid": "GPU-" + uuid[4:].lower(),
        "pid": pid,
        "requires_grad": boolean("requires_grad"),
        "event_sync_required": sync,
    }
    if out["storage_device"] > 0xFFFFFFFF:
        raise _field("storage_device", f"{out['storage_device']} is too large")
    if event is not None:
        out["event_handle"] = event
    if "ref_counter_handle" in get:
        out["ref_counter_handle"] = _hex("ref_counter_handle", get["ref_counter_handle"])
    if "ref_counter_offset" in get:
        out["ref_counter_offset"] = _u64("ref_counter_offset", get["ref_counter_offset"])
    if "alloc_size" in get:
        out["alloc_size"] = _u64("alloc_size", get["alloc_size"])
    return out


def record_to_json(record):
    """A validated record (bytes fields) as JSON-ready dict (hex strings)."""
    out = dict(record)
    for k in ("storage_handle", "event_handle", "ref_counter_handle"):
        if k in out and isinstance(out[k], (bytes, bytearray)):
            out[k] = bytes(out[k]).hex()
    return out


def _extent(shape, strides, given):
    dims = sorted((s, d, i) for i, (d, s) in enumerate(zip(shape, strides)) if d > 1)
    span = 1
    for s, d, i in dims:
        if s < span:
            raise _field(
                "tensor_stride",
                f"{list(given)} with tensor_size {list(shape)}: dimension {i} (stride {s}) reaches "
                "elements that other indices reach too (overlapping or broadcast strides); make "
                "the tensor contiguous first",
            )
        span += (d - 1) * s
    return span


def tensor_layout(record):
    """Where the tensor lies in the shared memory and what it holds:
    ``{"offset", "len", "dtype" (descriptor name), "shape", "strides" (None when
    contiguous)}``. Refuses negative and overlapping strides and tensors that
    pass the end of their storage."""
    dt = _dtypes.from_torch(record["dtype"])
    elem = dt.size
    shape = list(record["tensor_size"])
    given = list(record["tensor_stride"])
    if len(given) != len(shape):
        raise _field("tensor_stride", f"{len(given)} strides for the {len(shape)} dimensions of tensor_size")
    strides = []
    for i, s in enumerate(given):
        if s < 0:
            raise _field(
                f"tensor_stride[{i}]",
                f"{s} is negative; negative strides cannot be described (make the tensor "
                "contiguous first)",
            )
        strides.append(s)
    numel = 1
    for d in shape:
        numel *= d
    if numel > _U64_MAX:
        raise _field("tensor_size", "the number of elements overflows")
    if numel == 0:
        raise _field("tensor_size", f"{shape} holds no elements; there is nothing to share")
    extent = _extent(shape, strides, given)
    length = extent * elem
    start = record["tensor_offset"] * elem
    end = start + length
    if end > record["storage_size_bytes"]:
        raise _field(
            "storage_size_bytes",
            f"the tensor reaches byte {end} of its storage (offset {record['tensor_offset']} "
            f"elements of {elem} bytes, {length} bytes long), but the storage has "
            f"{record['storage_size_bytes']} bytes",
        )
    offset = record["storage_offset_bytes"] + start
    row_major, acc = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        row_major[i] = acc
        acc *= shape[i]
    contiguous = all(d == 1 or a == b for a, b, d in zip(row_major, strides, shape))
    return {"offset": offset, "len": length, "dtype": dt.name, "shape": shape,
            "strides": None if contiguous else strides}


def record_to_descriptor(record):
    """A record (validated or not) as a descriptor dict.

    ``'c'`` handles give legacy descriptors; ``'e'`` handles of one physical
    allocation give vmm (POSIX fd) or fabric descriptors. ``'e'`` handles of
    several allocations cannot be one descriptor: :class:`TorchRecordError`
    (``cuda_ipc.open`` maps such a record directly).
    """
    validated = isinstance(record, dict) and isinstance(record.get("storage_handle"), (bytes, bytearray))
    r = record if validated else validate_record(record)
    storage = parse_storage_handle(r["storage_handle"])
    layout = tensor_layout(r)
    storage_end = r["storage_offset_bytes"] + r["storage_size_bytes"]
    d = {"cuda_ipc": 1}
    if storage["type"] == "c":
        alloc = r.get("alloc_size")
        if alloc is not None and alloc < storage_end:
            raise _field(
                "alloc_size",
                f"{alloc} bytes, but the storage ends at byte {storage_end} of the allocation",
            )
        d.update(mechanism="legacy", handle=storage["handle"].hex(),
                 alloc_size=storage_end if alloc is None else alloc)
        pid = r["pid"]
    else:
        check_segment(r, storage)
        handles = storage["handles"]
        if len(handles) != 1:
            kind = "POSIX file descriptors" if storage["kind"] == "fd" else "fabric handles"
            raise _err(
                f"the tensor lies in an expandable segment shared as {len(handles)} {kind}: a "
                "descriptor names one allocation, so it cannot describe this share. Import the "
                "segments with vmm::VmmMapping::import_segments (see torch::ExpandableSegment), "
                "or share the tensor from a process without expandable_segments:True"
            )
        if storage["kind"] == "fd":
            d.update(mechanism="vmm", fd=handles[0])
        else:
            d.update(mechanism="fabric", handle=handles[0].hex())
        d["alloc_size"] = storage["segment_size"]
        pid = storage["pid"]
    d.update(offset=layout["offset"], len=layout["len"], dtype=layout["dtype"],
             shape=layout["shape"], device_uuid=r["device_uuid"], pid=pid)
    if layout["strides"] is not None:
        d["strides"] = layout["strides"]
    if r["event_sync_required"] and r.get("event_handle") is not None:
        d["event"] = r["event_handle"].hex()
    return validate_descriptor(d)


def check_segment(r, storage):
    """Checks an expandable segment against the record (same owner, storage
    inside the shared range)."""
    if storage["pid"] != r["pid"]:
        raise _err(
            f"the storage handle names process {storage['pid']} as the owner of the segment, "
            f"but the record's pid is {r['pid']}"
        )
    mapped = storage["segment_size"] * len(storage["handles"])
    storage_end = r["storage_offset_bytes"] + r["storage_size_bytes"]
    if storage_end > mapped:
        raise _field(
            "storage_size_bytes",
            f"the storage ends at byte {storage_end} of the shared range, but the storage "
            f"handle shares {mapped} bytes ({len(storage['handles'])} segment(s) of "
            f"{storage['segment_size']})",
        )
