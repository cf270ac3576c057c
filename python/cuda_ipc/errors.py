"""The exceptions of cuda_ipc: one class per kind of error of the Rust
library (``cuda_ipc::ErrorKind``), all under :class:`CudaIpcError`.

The message is the library's one sentence, the same the ``cuda-ipc``
command prints after ``cuda-ipc: error:``. ``kind`` names the class of the
error (``"unavailable"``, ``"invalid_input"``, ``"peer"``, ``"timeout"``,
``"failed"``). A failed driver call is a :class:`DriverError` (of the
subclass for its kind) with ``call``, ``code``, ``name`` and ``hint``.

::

    CudaIpcError
    ├── Unavailable             no driver or device, or the feature is missing here
    │   ├── DriverNotFound      libcuda.so.1 missing, too old, or disabled
    │   ├── NoDevice
    │   ├── Unsupported
    │   └── DriverUnavailable   (also DriverError)
    ├── InvalidInput            (also ValueError) malformed input
    │   ├── DescriptorError     names the field
    │   ├── TorchRecordError
    │   ├── SameProcess         opening one's own legacy handle
    │   └── DriverInvalidInput  (also DriverError)
    ├── PeerGone                the other process exited or refused
    │   ├── ServiceError        a service (or publisher) refused a request: ``code``
    │   └── DriverPeerGone      (also DriverError)
    ├── Timeout                 (also TimeoutError)
    │   └── DriverTimeout       (also DriverError)
    ├── Failed                  a driver or system call failed at run time
    │   └── DriverError
    └── MissingDependency       (also ImportError) torch or cupy not installed
"""

__all__ = [
    "CudaIpcError",
    "Unavailable",
    "DriverNotFound",
    "NoDevice",
    "Unsupported",
    "InvalidInput",
    "DescriptorError",
    "TorchRecordError",
    "SameProcess",
    "Asleep",
    "PeerGone",
    "ServiceError",
    "Timeout",
    "Failed",
    "DriverError",
    "DriverUnavailable",
    "DriverInvalidInput",
    "DriverPeerGone",
    "DriverTimeout",
    "MissingDependency",
]


def __dir__():
    # dir() shows the module's API, not its imports and helpers.
    return sorted(__all__)


class CudaIpcError(Exception):
    """Base class of every error raised by cuda_ipc.

    ``kind`` is the error's class; ``call``, ``code``, ``name`` and ``hint``
    are set for driver errors and ``None`` otherwise.
    """

    kind: "str | None" = None
    call: "str | None" = None
    code: "int | str | None" = None
    name: "str | None" = None
    hint: "str | None" = None


class Unavailable(CudaIpcError):
    """No usable driver or device, or the device or platform lacks a feature."""

    kind = "unavailable"


class DriverNotFound(Unavailable):
    """libcuda.so.1 could not be loaded, is older than CUDA 13.0, or
    ``CUDA_IPC_DISABLE_DRIVER`` is set."""


class NoDevice(Unavailable):
    """The driver sees no device, or not the one asked for."""


class Unsupported(Unavailable):
    """This machine, kernel or driver cannot do what was asked."""


class InvalidInput(CudaIpcError, ValueError):
    """The input was malformed or inconsistent (a descriptor, a record, a
    handle, a size, a range)."""

    kind = "invalid_input"


class DescriptorError(InvalidInput):
    """A descriptor field is missing or malformed; ``field`` and ``reason``
    say which and why."""

    field = None
    reason = None


class TorchRecordError(InvalidInput):
    """A PyTorch share record is malformed or of an unsupported kind."""

    reason = None


class SameProcess(InvalidInput):
    """A process opened its own legacy IPC handle, which CUDA refuses
    (``code`` is 201, CUDA_ERROR_INVALID_CONTEXT)."""


class Asleep(InvalidInput):
    """A module was called on memory that sleeps (``Subscriber.sleep``,
    ``Reader.step_aside``): nothing was queued on the GPU. Wake it, or
    come back, first. ``ranges`` are the sleeping ``(base, bytes)``."""

    ranges = ()


class PeerGone(CudaIpcError):
    """The other process is gone, or refused us."""

    kind = "peer"


class ServiceError(PeerGone):
    """The other side answered a request with a refusal: ``code`` is its
    machine-readable reason (a weight service's ``over_quota``,
    ``writing``, ``not_found``, ``leased``, ``layout_mismatch``, ...; a
    publisher's ``not_found``, ``wrong_kind``), the message says what to
    do. Still a :class:`PeerGone` (the kind ``"peer"``), as before it had a
    class of its own."""


class Timeout(CudaIpcError, TimeoutError):
    """A wait ran out of time."""

    kind = "timeout"


class Failed(CudaIpcError):
    """A driver call or a system call failed at run time."""

    kind = "failed"


class DriverError(Failed):
    """A CUDA driver call failed: ``call`` (the C function), ``code`` (the
    raw ``CUresult``), ``name`` (e.g. ``CUDA_ERROR_INVALID_CONTEXT``),
    ``hint`` (what it usually means, or ``None``). The subclasses below say
    when the code means something else than a run-time failure."""


class DriverUnavailable(DriverError, Unavailable):
    """A driver call said the device or platform cannot do it."""

    kind = "unavailable"


class DriverInvalidInput(DriverError, InvalidInput):
    """A driver call refused its input (a bogus or foreign handle)."""

    kind = "invalid_input"


class DriverPeerGone(DriverError, PeerGone):
    """A driver call failed because the other process is gone."""

    kind = "peer"


class DriverTimeout(DriverError, Timeout):
    """A driver call timed out."""

    kind = "timeout"


class MissingDependency(CudaIpcError, ImportError):
    """An optional package this function needs (torch or cupy) is not
    installed. Also an ``ImportError``, so ``except ImportError`` works."""
