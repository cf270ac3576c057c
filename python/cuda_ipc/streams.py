"""What a publish or an update is ordered after.

A hand-off's event (and fence) must come after the writes of what it
hands off. The framework-neutral calls (:meth:`Publisher.update`,
:meth:`Publisher.publish_set`, :meth:`Publisher.update_set`,
:meth:`RingPublisher.publish`) wait on the host for every stream of the
device unless they are given ``stream=``; the state dict calls
(:meth:`Publisher.publish_state_dict`, :meth:`Publisher.update_state_dict`)
follow PyTorch's rule and are ordered after its current stream (or the
``stream=`` given), on the device: the call returns without waiting for
the GPU, and the subscriber's wait covers the writes queued before it.

``stream`` may be a ``torch.cuda.Stream``, a CuPy stream, any object with
``__cuda_stream__`` (the CUDA stream protocol), or a raw ``CUstream``
handle (an int; 0 is the legacy default stream). It must be a stream of
the publisher's device (the library checks with the driver), alive for the
call.
"""

import contextlib
import sys

from .errors import InvalidInput

__all__ = ["stream_handle"]


def __dir__():
    # dir() shows the module's API, not its imports and helpers.
    return sorted(__all__)


def stream_handle(stream):
    """The raw ``CUstream`` handle (an int) of ``stream``; ``None`` stays
    ``None``. Raises :class:`InvalidInput` for anything else."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise InvalidInput(f"stream must be a stream or a stream handle (int), not {stream!r}")
    if isinstance(stream, int):
        if stream < 0 or stream >= 1 << 64:
            raise InvalidInput(f"the stream handle {stream} is not a pointer (0 <= handle < 2**64)")
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        got = protocol() if callable(protocol) else protocol
        if (not isinstance(got, tuple) or len(got) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in got)):
            raise InvalidInput(f"{type(stream).__name__}.__cuda_stream__() gave {got!r}, "
                               f"not (version, handle)")
        return stream_handle(got[1])
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        h = getattr(stream, attr, None)
        if isinstance(h, int) and not isinstance(h, bool):
            return stream_handle(h)
    raise InvalidInput(
        f"stream must be a torch.cuda.Stream, a CuPy stream, an object with __cuda_stream__ or a "
        f"raw stream handle (int), not {type(stream).__name__}")


# PyTorch's module and its function of a device index that gives the raw
# handle of its current stream there, looked up once per module (see
# _current_of).
_current = (None, None)


def _current_of(torch):
    """``torch``'s current-stream function (``torch._C._cuda_getCurrentRawStream``,
    or, in a PyTorch without it, one through ``torch.cuda.current_stream``),
    looked up the first time and kept: an update then costs one C call
    here, not a chain of look-ups run cold after a training step."""
    global _current
    module, current = _current
    if module is not torch:
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        current = raw if raw is not None else (lambda device: torch.cuda.current_stream(device).cuda_stream)
        _current = (torch, current)
    return current


def torch_current(torch, device):
    """The raw handle of PyTorch's current stream on ``device`` (an index)."""
    return int(_current_of(torch)(device))


def torch_current_if_loaded(device):
    """:func:`torch_current`, or ``None`` (the whole device) where PyTorch
    is not loaded: no PyTorch stream can hold writes then."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch_current(torch, device)


def torch_on(torch, device, stream):
    """A ``with`` block in which PyTorch's current stream on ``device`` is
    ``stream`` (``None``: left as it is), so that the copies a state dict
    call makes run where the caller's writes did."""
    if stream is None:
        return contextlib.nullcontext()
    if not isinstance(stream, torch.cuda.Stream):
        handle = stream_handle(stream)
        stream = (torch.cuda.default_stream(device) if handle == 0
                  else torch.cuda.ExternalStream(handle, device=torch.device("cuda", device)))
    elif stream.device.index != device:
        raise InvalidInput(f"the stream is on {stream.device}, the publisher on cuda:{device}; "
                           f"pass a stream of the publisher's device")
    return torch.cuda.stream(stream)
