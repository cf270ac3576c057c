"""Tensors born shareable: a PyTorch allocator on a publisher's arena.

::

    pub = cuda_ipc.Publisher("trainer")
    with cuda_ipc.torch.shareable(pub):
        model = Net().cuda()                 # every weight lands in pub's arena
    shared = pub.publish_state_dict("model", model.state_dict())   # no copy, no warning
    ...; opt.step(); pub.update_state_dict("model")

A model whose size is known before it is made (built on the ``meta``
device) fits in one chunk of the arena, which a new consumer maps once::

    with torch.device("meta"):
        size = cuda_ipc.torch.reserve_bytes(Net())
    with cuda_ipc.torch.shareable(pub, reserve=size):
        model = Net().cuda()

How: the extension module exports two C functions,
``cuda_ipc_torch_alloc(size, device, stream)`` and
``cuda_ipc_torch_free(ptr, size, device, stream)``, which
``torch.cuda.memory.CUDAPluggableAllocator`` loads from the extension's
shared object (``cuda_ipc._core.__file__``). :func:`shareable` makes one
``torch.cuda.MemPool`` over them per publisher and routes the block's
allocations on the publisher's device to it (``torch.cuda.use_mem_pool``).
PyTorch's caching allocator asks the pool for *segments*, which come from the
publisher's arena (``Publisher.alloc``: no export, chunks exported once), and
places tensors inside them; ``publish_state_dict`` finds each tensor's
segment and publishes the tensor as a byte range of it.

Lifetimes and limits:

- One publisher per device is the allocator's source at a time (the C
  functions are told a device, not a pool); nesting the same publisher is
  fine, another publisher on the same device raises ``InvalidInput``.
- Only the thread that runs the block allocates in the pool (PyTorch's
  rule): tensors made by other threads, e.g. gradients made by autograd's
  device threads during ``backward()``, come from PyTorch's usual memory.
  Parameters, buffers and optimizer state made in the block are in the
  arena, and an optimizer step updates them in place.
- Segments are owned by the allocator until PyTorch frees them, whatever
  happens to the publisher: closing the publisher stops new allocations in
  its pool (they raise ``torch.OutOfMemoryError`` saying why) but leaves
  every tensor made in it valid. A segment that a published set uses stays
  allocated in the arena until the set's last lease ends, as any arena
  buffer.
- The pool lives on the publisher object (:func:`pool`); tensors freed in
  it go back to the pool's cache. PyTorch frees a pool's segments only once
  the pool itself is let go of: ``torch.cuda.empty_cache()`` leaves the
  segments of a pool in use where they are (PyTorch 2.11). So
  :func:`empty_cache` lets go of the publisher's pool and empties the
  caches: free segments go back to the arena at once, the others as their
  tensors are freed (and ``torch.cuda.empty_cache()`` runs); the next
  :func:`shareable` block makes a new pool. ``Publisher.close()`` lets go
  of the pool too.
- A published tensor must not be freed and its memory reused while
  subscribers read it: ``publish_state_dict`` keeps the tensors it
  published until ``unpublish``.
- An allocation the arena cannot serve (the device is full, the arena's
  limit) returns null to PyTorch, which frees its cached blocks, retries,
  then raises ``torch.OutOfMemoryError`` with its own message. When the
  error leaves the :func:`shareable` block, the block adds the arena's
  reason to the message; code that catches it inside the block gets the
  reason from :func:`last_error`.

Importing this module does not import torch; :func:`shareable` does.
"""

import contextlib
import threading

from . import _core
from .errors import InvalidInput
from .mapping import _torch

__all__ = ["shareable", "reserve_bytes", "pool", "empty_cache", "allocator", "last_error", "segments"]


def __dir__():
    # dir() shows the module's API, not its imports and helpers.
    return sorted(__all__)

_lock = threading.Lock()
_allocator = None


def allocator():
    """The process's ``torch.cuda.memory.CUDAPluggableAllocator`` over the
    extension's two C functions (made once)."""
    global _allocator
    with _lock:
        if _allocator is None:
            torch = _torch()
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(
                _core.__file__, _core.SHAREABLE_ALLOC, _core.SHAREABLE_FREE
            )
        return _allocator


def pool(publisher):
    """The ``torch.cuda.MemPool`` of ``publisher`` on its device, made on
    first use and kept on the publisher object."""
    p = getattr(publisher, "_torch_pool", None)
    if p is None:
        torch = _torch()
        plug = allocator()
        with torch.cuda.device(publisher.device):
            p = torch.cuda.MemPool(plug.allocator())
        publisher._torch_pool = p
    return p


def empty_cache(publisher):
    """Gives the free segments of ``publisher``'s pool back to its arena:
    lets go of the pool (tensors made in it stay valid; their segments go
    back as they are freed) and calls ``torch.cuda.empty_cache()``. The
    next :func:`shareable` block makes a new pool. Raises
    :class:`~cuda_ipc.InvalidInput` inside a :func:`shareable` block of
    ``publisher``. Returns :func:`segments` afterwards."""
    if getattr(publisher, "_torch_blocks", 0):
        raise InvalidInput(
            "cuda_ipc.torch.empty_cache(publisher) inside a shareable(publisher) block: "
            "call it after the block"
        )
    publisher._torch_pool = None
    torch = _torch()
    torch.cuda.synchronize(publisher.device)
    torch.cuda.empty_cache()
    return segments()


def last_error():
    """Why the last allocation or free of the allocator failed (and
    forgets it), or ``None``."""
    return _core.shareable_error()


def segments():
    """``(count, bytes)`` of the segments the allocator holds now (arena
    buffers that PyTorch has not freed)."""
    return _core.shareable_segments()


# PyTorch's caching allocator (2.x): blocks of 1 MiB and more are rounded up
# to 2 MiB; smaller ones to 512 bytes, packed into 2 MiB segments; blocks
# of 1 to 10 MiB are cut from 20 MiB segments.
_MIB = 1 << 20
_SMALL = _MIB
_ROUND_LARGE = 2 * _MIB
_ROUND_SMALL = 512
_MID_SEGMENT = 20 * _MIB


def _round_up(n, unit):
    return -(-n // unit) * unit


def reserve_bytes(tensors):
    """The bytes :func:`shareable` should ``reserve`` so that ``tensors``
    (an iterable of tensors, a state dict, or a ``torch.nn.Module``: its
    parameters and buffers; on any device, ``meta`` included, so a model's
    size is known before it is made) fit in one chunk of the arena, as
    PyTorch's caching allocator places them: each block of 1 MiB or more
    rounded up to 2 MiB, the smaller ones rounded up to 512 bytes and
    packed into 2 MiB segments, and one 20 MiB segment more for the last
    partly used segment of blocks between 1 and 10 MiB. A tensor that
    appears twice (tied weights) counts once."""
    if hasattr(tensors, "parameters") and hasattr(tensors, "buffers"):
        tensors = list(tensors.parameters()) + list(tensors.buffers())
    elif hasattr(tensors, "values"):
        tensors = tensors.values()
    seen, large, small = set(), 0, 0
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        try:
            n = int(t.numel()) * int(t.element_size())
        except AttributeError:
            raise InvalidInput(
                f"cuda_ipc.torch.reserve_bytes: expected tensors, found {type(t).__name__}"
            ) from None
        # PyTorch puts a block of exactly 1 MiB in its small pool (two to a
        # 2 MiB segment); counting it as large errs on the safe side.
        if n >= _SMALL:
            large += _round_up(n, _ROUND_LARGE)
        elif n:
            small += _round_up(n, _ROUND_SMALL)
    if not large and not small:
        return 0
    return large + _round_up(small, _ROUND_LARGE) + (_MID_SEGMENT if large else 0)


@contextlib.contextmanager
def shareable(publisher, reserve=None):
    """Inside the block, tensors made on ``publisher``'s device (which the
    block makes the current device) live in ``publisher``'s arena, so
    :meth:`Publisher.publish_state_dict` publishes them without a copy.
    Yields the ``torch.cuda.MemPool``. See the module documentation for the
    lifetimes.

    ``reserve`` (bytes, e.g. :func:`reserve_bytes` of the model built on
    the ``meta`` device): the arena first makes sure it has that much free,
    in one chunk made now if not (:meth:`Publisher.reserve`). Without it the
    arena grows chunk by chunk as PyTorch asks (256 MiB, 256 MiB, 512 MiB,
    up to 2 GiB each), and every chunk costs a new consumer one more
    mapping when it first attaches (``bench/first_attach.py`` measures
    it)."""
    if reserve is not None and (isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0):
        raise InvalidInput(
            f"cuda_ipc.torch.shareable: reserve is a number of bytes (0 or more), not {reserve!r}"
        )
    torch = _torch()
    if reserve:
        publisher.reserve(reserve)
    mem_pool = pool(publisher)
    _core.shareable_enter(publisher._c)
    publisher._torch_blocks = getattr(publisher, "_torch_blocks", 0) + 1
    try:
        with torch.cuda.device(publisher.device), torch.cuda.use_mem_pool(mem_pool, device=publisher.device):
            yield mem_pool
    except torch.cuda.OutOfMemoryError as e:
        reason = _core.shareable_error()
        if reason and e.args:
            e.args = (f"{e.args[0]}\ncuda_ipc.torch.shareable: {reason}",) + tuple(e.args[1:])
        raise
    finally:
        publisher._torch_blocks -= 1
        _core.shareable_exit(publisher._c)
