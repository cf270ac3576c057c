"""State dicts through PyTorch's DLPack C exchange API.

PyTorch 2.10 and later set ``torch.Tensor.__dlpack_c_exchange_api__``, a
capsule of C functions that read a tensor's address, dtype, shape, strides
and device and make a tensor over memory without Python. Where it is there,
:meth:`Publisher.publish_state_dict`, :meth:`Subscriber.attach_state_dict`
and :meth:`Publisher.update_state_dict` with a state dict loop over the
tensors in the extension module (``_core.publish_state_dict_c``,
``_core.attach_state_dict_c``, ``StateDictRecord.changed``): one call each
from Python, whatever the number of tensors. Elsewhere (an older PyTorch, or
``CUDA_IPC_TORCH_C_API=0`` in the environment) they take the path of
:mod:`cuda_ipc.sets`, a loop in Python with the same results.

The choice is made once per process, when a state dict is first published
or attached (importing :mod:`cuda_ipc` does not import torch); :func:`status`
says which path is in use and why. The extension checks the capsule (its
name, DLPack version 1.3 or a later 1.x, the functions it needs) and a
capsule it cannot read means the Python path, not an error.

Lifetimes are those of the Python path: every attached tensor holds the
set's lease and mappings until it dies (the tensor's DLPack deleter lets go
of them, without waiting for the GPU or the publisher); a published state
dict keeps the tensors it returned until ``unpublish``.
"""

import os
import threading

from . import _core
from . import dtypes as _dtypes
from .errors import CudaIpcError, MissingDependency
from .mapping import _as_torch, _torch

__all__ = ["ENV", "status", "exchange"]

# Set to 0 to use the Python path even where PyTorch has the C API.
ENV = "CUDA_IPC_TORCH_C_API"

_lock = threading.Lock()
# (TorchExchange or None, why not, torch's dtype tables), once chosen.
_chosen = None


def choose(torch, env=None):
    """``(exchange, reason)`` for ``torch`` (a module with ``Tensor``):
    ``exchange`` is a ``_core.TorchExchange`` or ``None``, ``reason`` says
    why not (``None`` when it is used). ``env`` stands for the environment."""
    env = os.environ if env is None else env
    if env.get(ENV, "").strip() == "0":
        return None, f"{ENV}=0 in the environment"
    capsule = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if capsule is None:
        return None, "this PyTorch has no torch.Tensor.__dlpack_c_exchange_api__ (PyTorch 2.10 and later have it)"
    try:
        return _core.TorchExchange(capsule, torch.Tensor), None
    except CudaIpcError as e:
        return None, f"torch.Tensor.__dlpack_c_exchange_api__ is not usable: {e}"


def _tables(torch):
    """``({torch dtype: set dtype name}, {set dtype name: torch dtype, or
    its torch name where this PyTorch lacks it})``."""
    by_torch, to_torch = {}, {}
    for d in _dtypes.DTYPES:
        t = getattr(torch, d.torch, None)
        to_torch[d.name] = d.torch if t is None else t
        if t is not None:
            by_torch[t] = d.name
    return by_torch, to_torch


def _state():
    """The choice, made on first use; ``None`` while torch is missing (the
    Python path then says what to install)."""
    global _chosen
    if _chosen is None:
        try:
            torch = _torch()
        except MissingDependency:
            return None
        with _lock:
            if _chosen is None:
                ex, why = choose(torch)
                _chosen = (ex, why, _tables(torch) if ex is not None else None)
    return _chosen


def exchange():
    """The ``_core.TorchExchange`` in use, or ``None`` (the Python path)."""
    s = _state()
    return None if s is None else s[0]


def status():
    """``(True, None)`` when state dicts go through the C API, else
    ``(False, why)``."""
    s = _state()
    if s is None:
        return False, "torch is not installed"
    return s[0] is not None, s[1]


def _use(exchange_or_none, why="chosen by a test"):
    """Makes the choice (for the tests): a ``TorchExchange``, or ``None``
    for the Python path; returns the previous choice, to restore with
    :func:`_restore`."""
    global _chosen
    with _lock:
        old = _chosen
        tables = _tables(_torch()) if exchange_or_none is not None else None
        _chosen = (exchange_or_none, None if exchange_or_none is not None else why, tables)
        return old


def _restore(old):
    global _chosen
    with _lock:
        _chosen = old


def publish_state_dict(pub, name, state_dict, stream):
    """:meth:`Publisher.publish_state_dict` through the C API, ordered after
    ``stream`` (PyTorch's current stream, a raw handle): returns
    ``(tensors, record, copied, copied_bytes, first_copied)``."""
    from . import sets as _sets

    ex, _why, (by_torch, _to) = _state()
    torch = _torch()
    device = torch.device("cuda", pub.device)

    def copy_in(buf, src, dt_name, shape):
        dst = _as_torch(lambda n, raw: buf.view(_dtypes.raw_name(n, raw), shape), dt_name)
        _sets._copy_into(torch, dst, src)  # on the current stream
        return dst

    def empty(t):
        return torch.empty(list(t.shape), dtype=t.dtype, device=device)

    with torch.no_grad():
        return _core.publish_state_dict_c(pub._c, name, state_dict, ex, by_torch, _sets.set_dtype, copy_in, empty,
                                          stream)


def update_copies(record, state_dict):
    """Copies what ``state_dict`` changed into the tensors of ``record``
    (a ``StateDictRecord``), after checking it; returns how many."""
    from . import sets as _sets

    ex, _why, (by_torch, _to) = _state()
    pairs = record.changed(state_dict, ex, by_torch, _sets.set_dtype)
    if pairs:
        torch = _torch()
        with torch.no_grad():
            for dst, src in pairs:
                _sets._copy_into(torch, dst, src)
    return len(pairs)


def attach_state_dict(core_attachment):
    """:meth:`Subscriber.attach_state_dict` through the C API."""
    from . import sets as _sets

    a = _sets.SetAttachment(core_attachment)
    sd = None
    try:
        ex, _why, (_by, to_torch) = _state()
        torch = _torch()
        # Tensors made through the C API skip torch.from_dlpack, which is
        # where PyTorch initialises CUDA for a first CUDA tensor.
        torch.cuda.init()
        device = torch.device("cuda", a.device)

        def empty(shape, dtype):
            return torch.empty(shape, dtype=dtype, device=device)

        sd = _sets.StateDict(a, {})
        _core.attach_state_dict_c(core_attachment, sd, ex, to_torch, empty)
    except BaseException:
        if sd is not None:
            sd.clear()
        sd = None
        a.__exit__(None, None, None)
        raise
    return sd
