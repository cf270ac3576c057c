"""Mapping descriptors (and PyTorch share records) in this process."""

import atexit
import json
import os
import threading
import weakref

from . import dtypes as _dtypes
from ._driver import driver
from ._os import fetch_fd
from .descriptor import cuda_array_interface, validate_descriptor
from .errors import CudaIpcError, DescriptorError, Unsupported
from .torch_record import check_segment, is_record, parse_storage_handle, record_to_descriptor, tensor_layout, validate_record

__all__ = ["open", "Mapping", "live_mappings"]

_SHUTTING_DOWN = False
_LIVE = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _wait_for(drv, stream, event):
    """Makes ``stream`` wait for ``event`` unless its record has completed:
    then there is nothing to wait for, and a queued wait on another
    process's event would make a GPU shared with that process switch to
    this one's context for nothing (about 0.15 ms on an H200)."""
    if not drv.event_complete(event):
        drv.stream_wait_event(stream, event)


@atexit.register
def _at_exit():
    # At exit the driver tears every mapping down with the process; calling
    # into it from finalizers while other libraries shut down is not safe.
    global _SHUTTING_DOWN
    _SHUTTING_DOWN = True


def live_mappings():
    """How many mappings this process holds that are not released yet
    (mappings closed while views are alive count until the views die)."""
    with _LIVE_LOCK:
        return sum(1 for r in list(_LIVE) if not r.released)


class _Resource:
    """What one open holds in the driver, undone in reverse order on release."""

    def __init__(self, ordinal, kind):
        self.ordinal = ordinal
        self.kind = kind
        self.released = False
        self.undo = []
        self.event = None
        self.views = weakref.WeakSet()
        self.lock = threading.Lock()
        with _LIVE_LOCK:
            _LIVE.add(self)

    def release(self):
        with self.lock:
            if self.released:
                return
            self.released = True
            undo, self.undo = self.undo, []
        if _SHUTTING_DOWN or not undo:
            return
        drv = driver()
        first = None
        with drv.bound(self.ordinal):
            # Work queued on this memory (by us, PyTorch or CuPy, on any
            # stream of the context) must finish before it is unmapped.
            try:
                drv.ctx_synchronize()
            except CudaIpcError as e:
                first = e
            for fn in reversed(undo):
                try:
                    fn()
                except CudaIpcError as e:
                    first = first or e
        if first is not None:
            raise first

    def __del__(self):
        try:
            self.release()
        except Exception:
            # Errors cannot be raised from a finalizer; a failed unmap means
            # the context is gone, which unmaps everything with it.
            pass


class _View:
    """The object a PyTorch tensor or CuPy array made by ``as_torch`` /
    ``as_cupy`` holds on to: it keeps the mapping alive."""

    __slots__ = ("_res", "__cuda_array_interface__", "__weakref__")

    def __init__(self, res, cai):
        self._res = res
        self.__cuda_array_interface__ = cai
        res.views.add(self)


def _stream_handle(stream):
    """A raw CUstream from None (the legacy default stream), an int, or a
    torch/cupy stream object."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    raise TypeError(f"cannot get a CUDA stream handle from {stream!r}")


class Mapping:
    """Memory another process exported, mapped here.

    ``ptr`` is the device address of the first exported byte (the
    descriptor's offset applied), ``nbytes`` the exported length. The object
    has a ``__cuda_array_interface__`` (version 3) with the descriptor's
    shape, strides and dtype, so ``torch.as_tensor(m, device="cuda")`` and
    ``cupy.asarray(m)`` see the memory without copying; prefer
    :meth:`as_torch` and :meth:`as_cupy`, whose results keep the mapping
    alive on their own.

    :meth:`close` unmaps at once when no ``as_torch``/``as_cupy`` view is
    alive, else when the last one dies. Objects built from the mapping's own
    ``__cuda_array_interface__`` are not tracked: do not close the mapping
    while they are in use. Dropping every reference closes it too.
    """

    def __init__(self, res, descriptor, ptr, waited_stream, segments=1):
        self._res = res
        self.descriptor = descriptor
        self.ptr = ptr
        self.nbytes = descriptor["len"]
        self.device = res.ordinal
        self.mechanism = descriptor["mechanism"] if segments == 1 else "torch_segments"
        self.segments = segments
        self.dtype = descriptor["dtype"]
        shape = descriptor.get("shape")
        self.shape = tuple(shape) if shape is not None else (descriptor["len"] // descriptor["elem_size"],)
        strides = descriptor.get("strides")
        self.strides = None if strides is None else tuple(strides)
        self._waited = waited_stream

    def __repr__(self):
        state = "closed" if self.closed else f"ptr=0x{self.ptr:x}"
        return (f"<cuda_ipc.Mapping {self.mechanism} {self.dtype}{list(self.shape)} "
                f"{self.nbytes} bytes on cuda:{self.device} {state}>")

    @property
    def closed(self):
        """Whether :meth:`close` was called (views may still hold the memory)."""
        return self._res is None

    def _resource(self):
        if self._res is None:
            raise CudaIpcError("the mapping is closed")
        return self._res

    @property
    def __cuda_array_interface__(self):
        res = self._resource()
        stream = None
        if res.event is not None:
            # The mapping's bytes are ready after the work queued on the
            # stream we made wait on the exporter's event.
            stream = 1 if self._waited == 0 else self._waited
        return cuda_array_interface(self.ptr, self.descriptor, stream=stream)

    def wait(self, stream=None):
        """Makes ``stream`` (a handle or a torch/cupy stream; default the
        legacy default stream) wait on the device for the exporter's event,
        if the descriptor carried one. ``as_torch``/``as_cupy`` do this for
        the framework's current stream."""
        res = self._resource()
        if res.event is None:
            return
        drv = driver()
        with drv.bound(res.ordinal):
            _wait_for(drv, _stream_handle(stream), res.event)

    def _target(self, dtype):
        own = _dtypes.by_name(self.dtype)
        if dtype is None:
            return own
        dt = _dtypes.lookup(dtype)
        if dt is None:
            raise CudaIpcError(f"unknown dtype {dtype!r}; known: {', '.join(_dtypes.names())}")
        if dt.size != own.size:
            raise CudaIpcError(
                f"cannot view {own.name} elements as {dt.name}: the element sizes differ "
                f"({own.size} and {dt.size} bytes)"
            )
        return dt

    def _view(self, raw):
        res = self._resource()
        return _View(res, cuda_array_interface(self.ptr, self.descriptor, stream=None, raw=raw))

    def as_torch(self, dtype=None):
        """A PyTorch tensor over the mapped memory (no copy), on this
        mapping's device, with the descriptor's shape and strides. The
        tensor keeps the mapping alive. ``dtype`` reinterprets the elements
        as another type of the same size (``"uint8"`` for bool, ...).

        The current PyTorch stream is made to wait for the exporter's event
        first, if there is one. Needs numpy (PyTorch reads the CUDA array
        interface through it)."""
        import torch

        dt = self._target(dtype)
        # Types whose typestr PyTorch reads are built directly; the others
        # (bf16, u16/u32/u64) from same-sized integers and reinterpreted.
        target = getattr(torch, dt.torch, None)
        if target is None:
            raise CudaIpcError(f"this PyTorch has no torch.{dt.torch}")
        raw = dt.name in ("bf16", "u16", "u32", "u64") or dt.name != self.dtype
        owner = self._view(raw)
        dev = torch.device("cuda", self.device)
        try:
            with torch.cuda.device(dev):
                self.wait(torch.cuda.current_stream(dev).cuda_stream)
                t = torch.as_tensor(owner, device=dev)
        except (RuntimeError, TypeError) as e:
            raise CudaIpcError(
                f"PyTorch could not wrap the mapping: {e}"
                + (" (install numpy: PyTorch reads the CUDA array interface through it)" if "umpy" in str(e) else "")
            ) from e
        if t.dtype != target:
            t = t.view(target)
        return t

    def as_cupy(self, dtype=None):
        """A CuPy array over the mapped memory (no copy), on this mapping's
        device, with the descriptor's shape and strides; it keeps the mapping
        alive. ``dtype`` reinterprets the elements as another type of the
        same size. bfloat16 needs ml_dtypes (else pass ``dtype="uint16"`` for
        the raw bits).

        The current CuPy stream is made to wait for the exporter's event
        first, if there is one."""
        import cupy

        dt = self._target(dtype)
        final = None
        if dt.name == "bf16":
            try:
                import ml_dtypes

                final = ml_dtypes.bfloat16
            except ImportError:
                raise CudaIpcError(
                    "CuPy has no bfloat16 type without ml_dtypes; install ml_dtypes, or call "
                    "as_cupy(dtype='uint16') for the raw bits"
                ) from None
        raw = dt.name == "bf16" or dt.name != self.dtype
        owner = self._view(raw)
        with cupy.cuda.Device(self.device):
            self.wait(cupy.cuda.get_current_stream().ptr)
            a = cupy.asarray(owner)
        if final is not None:
            a = a.view(final)
        elif a.dtype.name != dt.numpy:
            a = a.view(dt.numpy)
        return a

    def close(self):
        """Unmaps now if no ``as_torch``/``as_cupy`` view is alive, else when
        the last one dies. Safe to call twice."""
        res, self._res = self._res, None
        if res is not None and not len(res.views):
            res.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _ordinal_for(drv, uuid, device):
    if device is not None:
        n = drv.device_count()
        if not 0 <= int(device) < n:
            raise CudaIpcError(f"CUDA device {device} is not available: the driver sees {n} device(s)")
        return int(device)
    ordinal = drv.ordinal_of(uuid)
    if ordinal is None:
        raise CudaIpcError(
            f"device {uuid} is not visible to this process (the driver sees "
            f"{drv.device_count()} device(s)); check CUDA_VISIBLE_DEVICES, or pass device="
        )
    return ordinal


def _take_fd(pid, fd):
    """pidfd_getfd, with the error naming the descriptor."""
    return fetch_fd(pid, fd)


def _import_segments(drv, res, ordinal, imports, segment_size):
    """Imports allocations of ``segment_size`` bytes each (``imports`` are
    callables returning a generic allocation handle) and maps them back to
    back; returns the base address."""
    handles = []
    for make in imports:
        h = make()
        handles.append(h)
        res.undo.append(lambda h=h: drv.mem_release(h))
    total = segment_size * len(handles)
    base = drv.address_reserve(total)
    res.undo.append(lambda: drv.address_free(base, total))
    for i, h in enumerate(handles):
        at = base + i * segment_size
        drv.mem_map(at, segment_size, h)
        res.undo.append(lambda at=at: drv.mem_unmap(at, segment_size))
    drv.mem_set_access(base, total, ordinal)
    return base


def _fd_import(drv, pid, fd):
    def make():
        mine = _take_fd(pid, fd)
        try:
            return drv.import_fd(mine)
        finally:
            # The driver keeps its own reference to the allocation.
            os.close(mine)
    return make


def _map(drv, res, d, ordinal, segments=None):
    """Maps descriptor ``d`` (or the torch segments); returns the base."""
    mech = d["mechanism"]
    if segments is not None:
        storage = segments
        if storage["kind"] == "fd":
            imports = [_fd_import(drv, storage["pid"], fd) for fd in storage["handles"]]
        else:
            imports = [(lambda h=h: drv.import_fabric(h)) for h in storage["handles"]]
        return _import_segments(drv, res, ordinal, imports, storage["segment_size"])
    if mech == "legacy":
        base = drv.ipc_open_mem_handle(bytes.fromhex(d["handle"]))
        res.undo.append(lambda: drv.ipc_close_mem_handle(base))
        _, size = drv.address_range(base)
        if d["offset"] + d["len"] > size:
            raise DescriptorError(
                "len",
                f"offset {d['offset']} + len {d['len']} passes the end of the {size}-byte "
                "allocation the handle names",
            )
        return base
    if mech == "vmm":
        return _import_segments(drv, res, ordinal, [_fd_import(drv, d["pid"], d["fd"])], d["alloc_size"])
    if mech == "fabric":
        h = bytes.fromhex(d["handle"])
        return _import_segments(drv, res, ordinal, [lambda: drv.import_fabric(h)], d["alloc_size"])
    if mech == "pool":
        mine = _take_fd(d["pid"], d["fd"])
        try:
            pool = drv.pool_import_fd(mine)
        finally:
            os.close(mine)
        res.undo.append(lambda: drv.pool_destroy(pool))
        drv.pool_ensure_access(pool, ordinal)
        ptr = drv.pool_import_pointer(pool, bytes.fromhex(d["handle"]))
        res.undo.append(lambda: drv.mem_free(ptr))
        _, size = drv.address_range(ptr)
        if d["offset"] + d["len"] > size:
            raise DescriptorError(
                "len",
                f"offset {d['offset']} + len {d['len']} passes the end of the {size}-byte pool allocation",
            )
        return ptr
    raise Unsupported(f"mechanism {mech!r}")


def open(descriptor, *, stream=None, device=None):  # noqa: A001 - the module's verb
    """Maps a descriptor (a dict or JSON text, as ``cuda-ipc export`` prints
    or ``export_torch`` returns) in this process and returns a
    :class:`Mapping`.

    - legacy: ``cuIpcOpenMemHandle`` (the offset applied);
    - vmm: ``pidfd_getfd`` of the exporter's descriptor, then
      ``cuMemImportFromShareableHandle``, reserve, map, set access;
    - pool: ``pidfd_getfd`` of the pool's descriptor, then
      ``cuMemPoolImportFromShareableHandle`` and ``cuMemPoolImportPointer``;
    - fabric: ``cuMemImportFromShareableHandle`` of the fabric handle.

    A PyTorch share record (``torch_share_record``) is accepted too,
    including expandable segments of several allocations.

    If the descriptor has an ``event``, it is opened and ``stream`` (default:
    the legacy default stream) is made to wait on it. ``device`` overrides
    the device found by UUID (an ordinal in this process).
    """
    obj = descriptor
    if isinstance(obj, (bytes, bytearray)):
        obj = obj.decode("utf-8", errors="replace")
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except ValueError as e:
            raise DescriptorError("(document)", f"not valid JSON: {e}") from None
    segments = None
    if is_record(obj):
        r = validate_record(obj)
        storage = parse_storage_handle(r["storage_handle"])
        if storage["type"] == "e" and len(storage["handles"]) > 1:
            check_segment(r, storage)
            layout = tensor_layout(r)
            d = {
                "cuda_ipc": 1, "mechanism": "vmm", "fd": 0,
                "alloc_size": storage["segment_size"] * len(storage["handles"]),
                "offset": layout["offset"], "len": layout["len"], "dtype": layout["dtype"],
                "shape": layout["shape"], "device_uuid": r["device_uuid"], "pid": storage["pid"],
            }
            if layout["strides"] is not None:
                d["strides"] = layout["strides"]
            if r["event_sync_required"]:
                d["event"] = r["event_handle"].hex()
            d = validate_descriptor(d)
            segments = storage
        else:
            d = record_to_descriptor(r)
    else:
        d = validate_descriptor(obj)

    drv = driver()
    ordinal = _ordinal_for(drv, d["device_uuid"], device)
    res = _Resource(ordinal, d["mechanism"])
    waited = _stream_handle(stream)
    try:
        with drv.bound(ordinal):
            base = _map(drv, res, d, ordinal, segments)
            if "event" in d:
                ev = drv.ipc_open_event_handle(bytes.fromhex(d["event"]))
                res.undo.append(lambda: drv.event_destroy(ev))
                res.event = ev
                _wait_for(drv, waited, ev)
    except BaseException:
        try:
            res.release()
        except CudaIpcError:
            pass
        raise
    n = 1 if segments is None else len(segments["handles"])
    return Mapping(res, d, base + d["offset"], waited, segments=n)
