"""Exporting PyTorch tensors and CuPy arrays as descriptors, through the
Rust library's exporter (legacy handles for ``cudaMalloc`` memory, vmm for
PyTorch's expandable segments, the pool mechanism for shareable pools)."""

import os
import warnings

from . import _core
from . import dtypes as _dtypes
from .errors import CudaIpcError, Unsupported
from .mapping import _cupy, _torch
from .torch_record import parse_storage_handle, validate_record

__all__ = ["Export", "export_torch", "export_cupy", "torch_share_record"]


class Export:
    """One export: what consumers need (``descriptor``) and what keeps the
    memory valid for them (the tensor or array, the event, the file
    descriptors of fd mechanisms).

    Keep it alive until every consumer is done with the memory. ``kind`` is
    ``"descriptor"`` or ``"torch_share"`` (``descriptor`` is then a PyTorch
    share record: a tensor in an expandable segment of several allocations,
    which ``cuda_ipc.open`` and Rust ``torch::ShareRecord`` read).
    """

    def __init__(self, kind, descriptor, keep, event=None, record=None, exported=None):
        self.kind = kind
        self.descriptor = descriptor
        self.event = event
        self.record = record
        self._keep = keep
        self._exported = exported

    def json(self):
        """The descriptor (or record) as one line of JSON."""
        import json

        return json.dumps(self.descriptor, separators=(",", ":"))

    @property
    def closed(self):
        return self._keep is None

    def close(self):
        """Lets go of the tensor or array, the event and the file
        descriptors. Safe to call twice."""
        if self._exported is not None:
            self._exported.close()
        self._keep = self._exported = self.event = None

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


def _record(tensor, event_handle=None):
    """The share record of ``tensor`` from ``reduce_tensor``'s arguments, with
    PyTorch's own IPC reference count for this share released at once
    (consumers that are not PyTorch never release it; liveness is the
    Export's job)."""
    torch = _torch()
    from torch.multiprocessing.reductions import reduce_tensor

    t = tensor.detach()
    _, args = reduce_tensor(t)
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size,
     storage_offset, requires_grad, rc_handle, rc_offset, ev_handle, ev_sync) = args
    if handle is None or storage_size == 0:
        raise CudaIpcError("the tensor's storage is empty; there is nothing to share")
    if rc_handle is not None:
        try:
            torch.UntypedStorage._release_ipc_counter_cuda(rc_handle, rc_offset)
        except Exception as e:  # pragma: no cover - depends on the PyTorch build
            warnings.warn(
                f"cuda_ipc could not release PyTorch's IPC reference count ({e}); the tensor's "
                "memory stays allocated after it is freed until torch.cuda.ipc_collect() finds it unused",
                RuntimeWarning,
                stacklevel=3,
            )
    record = {
        "torch_share": 1,
        "storage_handle": bytes(handle).hex(),
        "storage_size_bytes": int(storage_size),
        "storage_offset_bytes": int(storage_offset),
        "tensor_size": list(size),
        "tensor_stride": list(stride),
        "tensor_offset": int(offset),
        "dtype": _dtypes.torch_name(dtype),
        "storage_device": int(device),
        "device_uuid": _core.device_uuid(int(device)),
        "pid": os.getpid(),
        "requires_grad": bool(requires_grad),
    }
    if rc_handle is not None:
        record["ref_counter_handle"] = bytes(rc_handle).hex()
        record["ref_counter_offset"] = int(rc_offset)
    if event_handle is not None:
        record["event_handle"] = bytes(event_handle).hex()
        record["event_sync_required"] = True
    elif ev_handle is not None and ev_sync:
        record["event_handle"] = bytes(ev_handle).hex()
        record["event_sync_required"] = True
    else:
        record["event_sync_required"] = False
    return t, validate_record(record), parse_storage_handle(bytes(handle))


def torch_share_record(tensor):
    """The PyTorch share record of a CUDA tensor (a dict ready for
    ``json.dumps``), as the Rust ``cuda_ipc::torch::ShareRecord`` reads it.
    The caller keeps the tensor alive until consumers are done."""
    _require_torch_cuda(tensor)
    _, record, _ = _record(tensor)
    return record


def _event_torch(torch, dev, stream):
    with torch.cuda.device(dev):
        s = stream if stream is not None else torch.cuda.current_stream(dev)
        event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
        event.record(s)
        return event, bytes(event.ipc_handle())


def export_torch(tensor, *, stream=None, allow_fd=True):
    """Exports a CUDA tensor; returns an :class:`Export` that holds the
    tensor, the event and the file descriptors.

    The Rust exporter picks the mechanism from the memory: a legacy handle
    for PyTorch's default allocator (``cudaMalloc`` blocks), vmm for
    ``expandable_segments:True`` (a file descriptor consumers take with
    ``pidfd_getfd``). A tensor spanning several expandable segments gives a
    PyTorch share record instead (``kind == "torch_share"``, with a
    warning). An interprocess event is recorded on ``stream`` (default: the
    current stream) and goes into the descriptor.

    ``allow_fd`` (default ``True``): whether memory shared by file
    descriptors (expandable segments, a shareable pool) may be exported. To
    let consumers take the descriptors, this process then names every
    process of its user as an allowed tracer (``PR_SET_PTRACER_ANY``, where
    Yama restricts ptrace). With ``allow_fd=False`` such a tensor raises
    :class:`cuda_ipc.Unsupported` and ptrace is left as it is.
    """
    torch = _require_torch_cuda(tensor)
    t = tensor.detach()
    dev = t.device
    name = _dtypes.torch_name(t.dtype)
    _core.dtype_from_torch(name)  # the library's message for types that cannot be shared
    event, ev_handle = _event_torch(torch, dev, stream)
    try:
        exported = _core.export_memory(t.data_ptr(), name, list(t.shape), list(t.stride()),
                                       device=dev.index, event=ev_handle, allow_fd=bool(allow_fd))
    except CudaIpcError as first:
        shared = _several_segments(t, ev_handle, allow_fd)
        if shared is None:
            raise
        return Export("torch_share", shared[1], keep=shared[0], event=event, record=shared[1])
    if exported.descriptor["mechanism"] == "vmm":
        # Expandable segments: the tensor must lie in one of PyTorch's
        # segments for one descriptor to name it; PyTorch's own storage
        # handle says how many the storage spans.
        shared = _several_segments(t, ev_handle, allow_fd)
        if shared is not None:
            exported.close()
            return Export("torch_share", shared[1], keep=shared[0], event=event, record=shared[1])
    return Export("descriptor", exported.descriptor, keep=t, event=event, exported=exported)


def _several_segments(t, ev_handle, allow_fd):
    """``(tensor, record)`` when ``t`` lies in an expandable segment of
    several allocations (shared as a PyTorch share record, with a warning),
    else ``None``."""
    try:
        t2, record, storage = _record(t, ev_handle)
    except CudaIpcError:
        return None
    if storage["type"] != "e" or len(storage["handles"]) < 2:
        return None
    if storage["kind"] == "fd" and not allow_fd:
        raise Unsupported(
            f"the tensor lies in an expandable segment shared as {len(storage['handles'])} "
            "allocations by file descriptors, which consumers take from this process with "
            "pidfd_getfd; pass allow_fd=True to let every process of this user do that (it may "
            "then ptrace this process: PR_SET_PTRACER_ANY)"
        )
    warnings.warn(
        f"the tensor lies in an expandable segment shared as {len(storage['handles'])} "
        "allocations, which one cuda-ipc descriptor cannot describe; returning a PyTorch "
        "share record instead (Export.kind == 'torch_share'), which cuda_ipc.open and Rust "
        "torch::ShareRecord read",
        UserWarning,
        stacklevel=3,
    )
    if storage["kind"] == "fd":
        _core.allow_fd_fetching()
    return t2, record


def export_cupy(array, *, stream=None, allow_fd=True):
    """Exports a CuPy array; returns an :class:`Export` that holds the array
    and the event. CuPy's default pool (``cudaMalloc`` chunks) gives a legacy
    descriptor at the array's offset in its chunk. Negative strides are
    refused. An interprocess event is recorded on ``stream`` (default: the
    current stream) and goes into the descriptor. ``allow_fd``: as for
    :func:`export_torch` (memory of a shareable pool is shared by a file
    descriptor)."""
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
    strides = []
    for i, s in enumerate(array.strides):
        if s % dt.size:
            raise CudaIpcError(f"stride {i} ({s} bytes) is not a whole number of {dt.size}-byte elements")
        strides.append(s // dt.size)
    ordinal = array.device.id
    with cupy.cuda.Device(ordinal):
        s = stream if stream is not None else cupy.cuda.get_current_stream()
        event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
        event.record(s)
        ev_handle = bytes(cupy.cuda.runtime.ipcGetEventHandle(event.ptr))
    exported = _core.export_memory(int(array.data.ptr), dt.name, [int(x) for x in array.shape], strides,
                                   device=ordinal, event=ev_handle, allow_fd=bool(allow_fd))
    return Export("descriptor", exported.descriptor, keep=array, event=event, exported=exported)
