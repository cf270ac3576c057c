"""Mapping descriptors (and PyTorch share records) in this process, through
the Rust library; the torch and CuPy conversions."""

from . import _core
from . import dtypes as _dtypes
from .errors import CudaIpcError, MissingDependency

__all__ = ["open", "Mapping", "live_mappings", "settle", "retiring"]


def __dir__():
    # dir() shows the module's API, not its imports and helpers.
    return sorted(__all__)


_loaded: dict = {}


def _import_optional(module, install):
    """Imports ``module``, or raises :class:`MissingDependency` saying how to
    install it. Remembers it: per-tensor paths call this (an import through
    importlib costs microseconds even when the module is loaded)."""
    found = _loaded.get(module)
    if found is not None:
        return found
    import importlib

    try:
        found = _loaded[module] = importlib.import_module(module)
        return found
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


def live_mappings():
    """How many mappings this process holds that are not unmapped yet
    (mappings closed while views are alive count until the views die, and
    until their release has run: see :func:`settle`)."""
    return _core.live_mappings()


def settle(timeout=None):
    """Waits up to ``timeout`` seconds (``None``: 10) until every release
    this process retired has run; returns whether none is left.

    Freeing a tensor, closing a mapping or dropping a state dict never
    waits: the unmap and the lease's release run on a thread of the
    library once the GPU work queued on the memory is done (a barrier over
    the device's context, since PyTorch's and CuPy's streams are theirs).
    Call this where a program must see that effect (memory back, the
    publisher told) before it goes on."""
    return _core.settle(timeout)


def retiring():
    """How many releases (unmaps, frees, lease releases) wait for their GPU
    work or for the library's thread to run them."""
    return _core.retiring()


class Mapping:
    """Memory another process exported, mapped here.

    ``ptr`` is the device address of the first exported byte, ``nbytes`` the
    exported length, ``shape``/``strides`` (elements) and ``dtype`` the
    descriptor's. The object speaks DLPack (``__dlpack__``,
    ``__dlpack_device__``) and the CUDA array interface, so
    ``torch.from_dlpack(m)`` and ``cupy.asarray(m)`` see the memory without
    copying; :meth:`as_torch` and :meth:`as_cupy` do that for you. Every
    tensor or array made from it keeps the memory mapped (through the DLPack
    capsule's deleter, or the object the array holds) until it dies.

    :meth:`close` lets go of this object's hold: the memory is unmapped at
    once when no view is alive, else when the last one dies. The exporter's
    event, if the descriptor carries one, was waited for by :func:`open`.
    """

    __slots__ = ("_m", "__weakref__")

    def __init__(self, core):
        self._m = core

    ptr = property(lambda self: self._m.ptr, doc="Device address of the first exported byte.")
    nbytes = property(lambda self: self._m.nbytes, doc="Exported length in bytes.")
    dtype = property(lambda self: self._m.dtype, doc="Element type (descriptor name).")
    shape = property(lambda self: self._m.shape, doc="Dimensions in elements.")
    strides = property(lambda self: self._m.strides, doc="Strides in elements, None when contiguous.")
    device = property(lambda self: self._m.device, doc="CUDA device ordinal.")
    mechanism = property(lambda self: self._m.mechanism, doc="legacy, vmm, pool, fabric or torch_segments.")
    segments = property(lambda self: self._m.segments, doc="How many allocations are mapped.")
    descriptor = property(lambda self: self._m.descriptor, doc="The descriptor, canonical.")
    closed = property(lambda self: self._m.closed, doc="Whether close() was called.")

    @property
    def __cuda_array_interface__(self):
        return self._m.__cuda_array_interface__

    def __dlpack__(self, **kwargs):
        return self._m.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._m.__dlpack_device__()

    def __repr__(self):
        return repr(self._m)

    def wait(self, stream=None):
        """Kept for compatibility: :func:`open` has already waited for the
        exporter's event."""

    def view(self, dtype=None, raw=False):
        """An object with DLPack and the CUDA array interface that keeps the
        memory mapped, as ``dtype`` (same element size) if given."""
        return self._m.view(None if dtype is None else _name(dtype), raw)

    def as_torch(self, dtype=None):
        """A PyTorch tensor over the mapped memory (no copy, through DLPack),
        on this mapping's device, with the descriptor's shape and strides. The
        tensor keeps the mapping alive. ``dtype`` reinterprets the elements as
        another type of the same size."""
        return _as_torch(self._m.view, self.dtype, dtype)

    def as_cupy(self, dtype=None):
        """A CuPy array over the mapped memory (no copy), on this mapping's
        device, with the descriptor's shape and strides; it keeps the mapping
        alive. ``dtype`` reinterprets the elements as another type of the
        same size. bfloat16 needs ml_dtypes (else pass ``dtype="uint16"``);
        the fp8 and fp4 types come as their bits (uint8), complex as
        complex."""
        return _as_cupy(self._m.view, self.dtype, self.device, dtype)

    def close(self):
        """Unmaps now if no view is alive, else when the last one dies. Safe
        to call twice."""
        self._m.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


_TORCH_RAW = frozenset(("bool", "u16", "u32", "u64")) | _dtypes.BITS_ONLY


def _as_torch(view, own, dtype=None):
    """A torch tensor over ``view(name, raw)`` (a core view factory) through
    DLPack: the capsule's deleter keeps the memory until the tensor dies."""
    torch = _torch()
    dt = _target(own, dtype)
    target = getattr(torch, dt.torch, None)
    if target is None:
        raise CudaIpcError(f"this PyTorch has no torch.{dt.torch}")
    # Types every PyTorch reads from DLPack are handed over as they are
    # (complex too: kDLComplex); bool and the unsigned types wider than a
    # byte as same-sized integers; the fp8/fp4 types as uint8, viewed back
    # below: their DLPack codes (10-17) are recent and a consumer that
    # predates them refuses them, while viewing a uint8 tensor as
    # torch.float8_e4m3fn (same element size) works in every PyTorch
    # that has the type (2.11 included).
    raw = dt.name in _TORCH_RAW
    # The capsule itself, not the object: torch.from_dlpack(obj) first asks
    # for torch's current stream and the device in Python (about 8 µs), for
    # a stream hand-shake that our views do not need (the memory is ready
    # on every stream when a view exists: the producer's event or fence was
    # waited for on the host).
    t = torch.from_dlpack(view(dt.name, raw).__dlpack__())
    if t.dtype != target:
        t = t.view(target)
    return t


def _as_cupy(view, own, device, dtype=None):
    """A CuPy array over ``view(name, raw)`` through the CUDA array
    interface; the array holds the view, which keeps the memory."""
    cupy = _cupy()
    dt = _target(own, dtype)
    if dt.name in _dtypes.BITS_ONLY:
        # CuPy has no fp8/fp4 types: their bits, as uint8.
        with cupy.cuda.Device(device):
            return cupy.asarray(view(dt.name, True))
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
    with cupy.cuda.Device(device):
        a = cupy.asarray(view(dt.name, dt.name == "bf16"))
    if final is not None:
        a = a.view(final)
    elif a.dtype.name != dt.numpy:
        a = a.view(dt.numpy)
    return a


def _name(dtype):
    dt = _dtypes.lookup(dtype)
    return dt.name if dt is not None else str(dtype)


def _target(own, dtype):
    if dtype is None:
        return _dtypes.by_name(own)
    dt = _dtypes.lookup(dtype)
    if dt is None:
        raise CudaIpcError(f"unknown dtype {dtype!r}; known: {', '.join(_dtypes.names())}")
    if dt.size != _dtypes.by_name(own).size:
        raise CudaIpcError(
            f"cannot view {own} elements as {dt.name}: the element sizes differ "
            f"({_dtypes.by_name(own).size} and {dt.size} bytes)"
        )
    return dt


def open(descriptor, *, stream=None, device=None):  # noqa: A001 - the module's verb
    """Maps a descriptor or a PyTorch share record (a dict, JSON text or
    bytes) and returns a :class:`Mapping`.

    The memory is mapped on the exporter's device (found by UUID) unless
    ``device`` (an ordinal) says otherwise. For the fd mechanisms without the
    channel, the exporter's descriptor is taken with ``pidfd_getfd`` (the
    exporter allows it; containers may forbid it: use the channel). If the
    descriptor carries an event, the host waits for it before returning
    (``stream`` is accepted for compatibility and not needed).
    """
    return Mapping(_core.open(descriptor, device=device))
