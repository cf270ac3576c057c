"""A clear error, not a faulted CUDA context, for a model run on weights
that sleep.

``Subscriber.sleep(unchecked=True)`` (and ``Reader.step_aside(...,
unchecked=True)``) keep tensors, a model's parameters and CUDA graphs over
them across the sleep: the caller promises to run nothing on them until the
wake. A kernel that reads a sleeping address would fault and poison the
process's CUDA context for good. So while any subscriber of this process
sleeps, every ``torch.nn.Module`` call (on any thread) first checks the
module's own parameters and buffers and its tensor arguments against the
sleeping address ranges, and raises :class:`cuda_ipc.Asleep`, naming the
module and the tensor, before anything is queued. The check is a global
forward pre-hook of PyTorch's, registered at the first sleep and removed
at the last wake: it costs nothing while nothing sleeps, and a bisection
per tensor while something does.

What it cannot see: an operation outside a module's call (``torch.matmul``
on a kept tensor, a CUDA graph's replay, a kernel of another library). Those
stay the caller's promise.
"""

import bisect
import sys
import threading
import weakref

from .errors import Asleep

_lock = threading.Lock()
# Subscriber (its core object's id) -> its sleeping ranges [(base, end)].
_by_subscriber = {}
# Every sleeping range, sorted by base: (bases, ends).
_flat = ((), ())
_handle = None
# Owner key -> the finalizer that forgets its ranges when the owner goes.
_finalizers = {}


def _rebuild():
    global _flat
    ranges = sorted(r for rs in _by_subscriber.values() for r in rs)
    _flat = (tuple(b for b, _ in ranges), tuple(e for _, e in ranges))


def guard(key, ranges):
    """Checks module calls against ``ranges`` (``[(base, bytes)]``, those
    of subscriber ``key``) until :func:`unguard` of ``key``. Does nothing
    where torch is not imported (nothing can run a module then)."""
    global _handle
    torch = sys.modules.get("torch")
    if torch is None or not ranges:
        return
    with _lock:
        _by_subscriber[key] = [(int(b), int(b) + int(n)) for b, n in ranges]
        _rebuild()
        if _handle is None:
            _handle = torch.nn.modules.module.register_module_forward_pre_hook(_check_call)


def unguard(key):
    """Stops checking subscriber ``key``'s ranges (it woke)."""
    global _handle
    with _lock:
        if _by_subscriber.pop(key, None) is None:
            return
        _rebuild()
        if not _by_subscriber and _handle is not None:
            _handle.remove()
            _handle = None


def watch(owner, ranges):
    """Checks module calls against ``ranges`` (``[(base, bytes)]``: what
    ``owner``, a subscriber, has asleep now) until they are empty or the
    owner goes."""
    key = id(owner)
    if not ranges:
        unguard(key)
        return
    guard(key, ranges)
    with _lock:
        if key not in _finalizers:
            _finalizers[key] = weakref.finalize(owner, _forget, key)


def _forget(key):
    with _lock:
        _finalizers.pop(key, None)
    unguard(key)


def sleeping(ptr):
    """Whether address ``ptr`` is in a sleeping range."""
    bases, ends = _flat
    i = bisect.bisect_right(bases, ptr) - 1
    return i >= 0 and ptr < ends[i]


def _is_cuda_tensor(t):
    return getattr(t, "is_cuda", False) and hasattr(t, "data_ptr")


def _check_call(module, args):
    """The forward pre-hook: raises before a module runs on sleeping memory."""
    if not _flat[0]:
        return None
    named = [("parameter " + n, p) for n, p in module._parameters.items()]
    named += [("buffer " + n, b) for n, b in module._buffers.items()]
    named += [("argument %d" % i, a) for i, a in enumerate(args)]
    for what, t in named:
        if t is not None and _is_cuda_tensor(t) and t.numel() and sleeping(t.data_ptr()):
            e = Asleep(
                f"{type(module).__name__}'s {what} is on memory that sleeps "
                f"(address {t.data_ptr():#x}): wake it (Subscriber.wake, Reader.wake) or come "
                f"back (Reader.come_back) before running the model; nothing was queued on the GPU"
            )
            e.ranges = tuple(zip(_flat[0], (end - base for base, end in zip(*_flat))))
            raise e
    return None
