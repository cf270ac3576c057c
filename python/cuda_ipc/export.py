"""Exporting PyTorch tensors and CuPy arrays as descriptors."""

import json
import os
import warnings

from . import dtypes as _dtypes
from ._driver import driver
from ._os import allow_fd_fetching
from .descriptor import validate_descriptor
from .errors import CudaIpcError, TorchRecordError
from .torch_record import parse_storage_handle, record_to_descriptor, record_to_json, validate_record

__all__ = ["Export", "MissingDependency", "export_torch", "export_cupy", "torch_share_record"]


class MissingDependency(CudaIpcError, ImportError):
    """An optional package this function needs (torch or cupy) is not
    installed. Also an ``ImportError``, so ``except ImportError`` works."""


def _import_optional(module, install):
    """Imports ``module``, or raises :class:`MissingDependency` saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module and not (e.name or "").startswith(module + "."):
            raise
        raise MissingDependency(
            f"this function needs {module}, which is not installed; install it with `{install}`"
        ) from e


def _torch():
    return _import_optional("torch", "pip install './python[torch]'  (or pip install torch)")


def _cupy():
    return _import_optional("cupy", "pip install './python[cupy]'  (or pip install cupy-cuda13x)")


class Export:
    """One export: what consumers need (``descriptor``) and what keeps the
    memory valid for them (the tensor or array, and the event).

    Keep it alive until every consumer is done with the memory: a consumer
    that still reads after :meth:`close` (or after the exporting process
    exits) reads freed memory, which may already hold something else.

    ``kind`` is ``"descriptor"`` (``descriptor`` is a cuda-ipc descriptor,
    for ``cuda-ipc open``, Rust ``share::open`` or ``cuda_ipc.open``) or
    ``"torch_share"`` (``descriptor`` is a PyTorch share record, for a tensor
    in an expandable segment of several allocations: ``cuda_ipc.open`` and
    Rust ``torch::ShareRecord`` read it; no single descriptor can).
    """

    def __init__(self, kind, descriptor, keep, event=None, record=None):
        self.kind = kind
        self.descriptor = descriptor
        self.record = record
        self._keep = keep
        self._event = event

    def json(self):
        """The descriptor (or record) as one line of JSON."""
        return json.dumps(self.descriptor, sort_keys=True, separators=(",", ":"))

    @property
    def closed(self):
        return self._keep is None

    def close(self):
        """Drops this export's references to the tensor or array and the
        event. The memory returns to its allocator when nothing else holds
        it. Call it only once every consumer is done."""
        self._keep = None
        self._event = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        state = "closed" if self.closed else "open"
        return f"<cuda_ipc.Export {self.kind} {self.descriptor.get('mechanism', 'torch_share')} {state}>"


def _require_torch_cuda(tensor):
    torch = _torch()

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cuda":
        raise CudaIpcError(f"the tensor is on {tensor.device}; only CUDA tensors can be shared")
    if tensor.layout != torch.strided or tensor.is_nested:
        raise CudaIpcError(
            f"only dense (strided) tensors can be shared; this one is {tensor.layout}"
            + (" and nested" if tensor.is_nested else "")
        )
    if tensor.numel() == 0:
        raise CudaIpcError(f"the tensor {tuple(tensor.shape)} holds no elements; there is nothing to share")
    return torch


def _reduce(tensor):
    """reduce_tensor's arguments for a detached view of ``tensor``, with
    PyTorch's own IPC reference count for this share released at once:
    consumers that are not PyTorch never release it, and the tensor would
    stay allocated in PyTorch's 'limbo' forever. Liveness is the Export's
    job instead."""
    torch = _torch()
    from torch.multiprocessing.reductions import reduce_tensor

    t = tensor.detach()
    _, args = reduce_tensor(t)
    (_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size,
     storage_offset, requires_grad, rc_handle, rc_offset, ev_handle, ev_sync) = args
    if handle is None or storage_size == 0:
        raise CudaIpcError("the tensor's storage is empty; there is nothing to share")
    if rc_handle is not None:
        try:
            torch.UntypedStorage._release_ipc_counter_cuda(rc_handle, rc_offset)
        except Exception as e:  # pragma: no cover - depends on the PyTorch build
            warnings.warn(
                f"cuda_ipc could not release PyTorch's IPC reference count ({e}); the tensor's "
                "memory will stay allocated after it is freed until torch.cuda.ipc_collect() "
                "finds it unused",
                RuntimeWarning,
                stacklevel=3,
            )
    return t, {
        "size": list(size), "stride": list(stride), "offset": int(offset),
        "dtype": _dtypes.torch_name(dtype), "device": int(device), "handle": bytes(handle),
        "storage_size": int(storage_size), "storage_offset": int(storage_offset),
        "requires_grad": bool(requires_grad), "rc_handle": rc_handle, "rc_offset": rc_offset,
        "event": ev_handle, "event_sync": bool(ev_sync),
    }


def _build_record(t, a, event_handle=None):
    drv = driver()
    record = {
        "torch_share": 1,
        "storage_handle": a["handle"].hex(),
        "storage_size_bytes": a["storage_size"],
        "storage_offset_bytes": a["storage_offset"],
        "tensor_size": a["size"],
        "tensor_stride": a["stride"],
        "tensor_offset": a["offset"],
        "dtype": a["dtype"],
        "storage_device": a["device"],
        "device_uuid": drv.device_uuid(a["device"]),
        "pid": os.getpid(),
        "requires_grad": a["requires_grad"],
    }
    if a["rc_handle"] is not None:
        record["ref_counter_handle"] = bytes(a["rc_handle"]).hex()
        record["ref_counter_offset"] = int(a["rc_offset"])
    if event_handle is not None:
        record["event_handle"] = bytes(event_handle).hex()
        record["event_sync_required"] = True
    elif a["event"] is not None and a["event_sync"]:
        record["event_handle"] = bytes(a["event"]).hex()
        record["event_sync_required"] = True
    else:
        record["event_sync_required"] = False
    storage = parse_storage_handle(a["handle"])
    if storage["type"] == "c":
        # The true size of the cudaMalloc allocation (PyTorch's tuple lacks it).
        ptr = t.untyped_storage().data_ptr()
        with drv.bound(a["device"]):
            base, size = drv.address_range(ptr)
        if ptr - base == a["storage_offset"]:
            record["alloc_size"] = size
    validate_record(record)
    return record, storage


def torch_share_record(tensor):
    """The PyTorch share record of a CUDA tensor (a dict ready for
    ``json.dumps``), as the Rust ``cuda_ipc::torch::ShareRecord`` reads it:
    ``reduce_tensor``'s arguments plus this process's pid and the device's
    UUID. It carries the event PyTorch recorded, if any.

    The caller must keep the tensor alive until consumers are done (PyTorch's
    own reference count for the share is released here, see
    ``docs/PYTHON.md``). Prefer :func:`export_torch`, which does that for you.
    """
    _require_torch_cuda(tensor)
    t, a = _reduce(tensor)
    record, _ = _build_record(t, a)
    return record


def export_torch(tensor, *, stream=None, allow_fd=True):
    """Exports a CUDA tensor; returns an :class:`Export` that holds the
    tensor (and the event) alive.

    - Memory from PyTorch's default allocator (a ``cudaMalloc`` block, storage
      handle type ``'c'``) gives a legacy descriptor: the block's IPC handle,
      the offset of the tensor's first element in it, shape, strides, dtype.
    - With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (type
      ``'e'``), a tensor inside one physical allocation gives a vmm
      descriptor naming PyTorch's file descriptor (consumers take it with
      ``pidfd_getfd``; with ``allow_fd``, this process lets processes of the
      same user do so, ``prctl(PR_SET_PTRACER_ANY)``); a tensor spanning
      several allocations gives a PyTorch share record instead
      (``Export.kind == "torch_share"``, with a warning).

    An interprocess event is recorded on ``stream`` (default: the tensor's
    device's current stream) after the work queued so far, and its handle
    goes into the descriptor: consumers wait on it before reading.
    """
    torch = _require_torch_cuda(tensor)
    t, a = _reduce(tensor)
    dev = t.device
    with torch.cuda.device(dev):
        s = stream if stream is not None else torch.cuda.current_stream(dev)
        event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
        event.record(s)
        ev_handle = bytes(event.ipc_handle())
    record, storage = _build_record(t, a, ev_handle)
    if storage["type"] == "e" and len(storage["handles"]) > 1:
        warnings.warn(
            f"the tensor lies in an expandable segment shared as {len(storage['handles'])} "
            "allocations, which one cuda-ipc descriptor cannot describe; returning a PyTorch "
            "share record instead (Export.kind == 'torch_share'), which cuda_ipc.open and Rust "
            "torch::ShareRecord read",
            UserWarning,
            stacklevel=2,
        )
        if storage["kind"] == "fd" and allow_fd:
            allow_fd_fetching()
        return Export("torch_share", record, keep=t, event=event, record=record)
    try:
        descriptor = record_to_descriptor(record)
    except TorchRecordError as e:
        raise CudaIpcError(f"cannot export this tensor: {e}") from e
    if descriptor["mechanism"] in ("vmm", "pool") and allow_fd:
        allow_fd_fetching()
    return Export("descriptor", descriptor, keep=t, event=event, record=record)


def export_cupy(array, *, stream=None):
    """Exports a CuPy array; returns an :class:`Export` that holds the array
    (and the event) alive.

    CuPy's memory pool sub-allocates from ``cudaMalloc`` chunks: the export
    finds the chunk with ``cuMemGetAddressRange``, takes its IPC handle with
    CuPy's ``ipcGetMemHandle`` and records the array's offset in it. Arrays
    from a stream-ordered pool (``cupy.cuda.MemoryAsyncPool``) cannot be
    shared this way: the error says so. Negative strides are refused.

    An interprocess event is recorded on ``stream`` (default: the current
    stream) and its handle goes into the descriptor.
    """
    cupy = _cupy()

    if not isinstance(array, cupy.ndarray):
        raise TypeError(f"expected a cupy.ndarray, got {type(array).__name__}")
    dt = _dtypes.from_numpy_name(array.dtype.name)
    if dt is None:
        raise CudaIpcError(
            f"dtype {array.dtype.name} cannot be shared; the element types that can are "
            + ", ".join(d.numpy for d in _dtypes.DTYPES)
        )
    if array.size == 0:
        raise CudaIpcError(f"the array {array.shape} holds no elements; there is nothing to share")
    shape = [int(x) for x in array.shape]
    strides = []
    for i, s in enumerate(array.strides):
        if s < 0:
            raise CudaIpcError(
                f"stride {i} is {s} bytes: negative strides cannot be described "
                "(use cupy.ascontiguousarray first)"
            )
        if s % dt.size:
            raise CudaIpcError(f"stride {i} ({s} bytes) is not a whole number of {dt.size}-byte elements")
        strides.append(s // dt.size)
    # Reuse the record's layout rules (overlap, extent, contiguity).
    from .torch_record import tensor_layout

    lay = tensor_layout({
        "dtype": dt.torch, "tensor_size": shape, "tensor_stride": strides, "tensor_offset": 0,
        "storage_size_bytes": 1 << 62, "storage_offset_bytes": 0,
    })
    drv = driver()
    ordinal = array.device.id
    ptr = int(array.data.ptr)
    with cupy.cuda.Device(ordinal):
        with drv.bound(ordinal):
            base, size = drv.address_range(ptr)
        try:
            handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
        except cupy.cuda.runtime.CUDARuntimeError as e:
            raise CudaIpcError(
                f"cudaIpcGetMemHandle failed ({e}): the array's memory is not from cudaMalloc "
                "(a stream-ordered pool such as cupy.cuda.MemoryAsyncPool cannot be shared with a "
                "legacy handle; use CuPy's default pool)"
            ) from e
        s = stream if stream is not None else cupy.cuda.get_current_stream()
        event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
        event.record(s)
        ev_handle = bytes(cupy.cuda.runtime.ipcGetEventHandle(event.ptr))
    d = {
        "cuda_ipc": 1, "mechanism": "legacy", "handle": handle.hex(), "alloc_size": size,
        "offset": ptr - base, "len": lay["len"], "dtype": dt.name, "shape": shape,
        "device_uuid": drv.device_uuid(ordinal), "pid": os.getpid(), "event": ev_handle.hex(),
    }
    if lay["strides"] is not None:
        d["strides"] = lay["strides"]
    return Export("descriptor", validate_descriptor(d), keep=array, event=event)


def record_json(record):
    """A record with bytes fields as JSON-ready hex (for records from
    ``validate_record``)."""
    return record_to_json(record)
