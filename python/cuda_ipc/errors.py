"""The exceptions of cuda_ipc.

Every failure is a :class:`CudaIpcError`. A failed driver call is a
:class:`DriverError` that names the C function and keeps the raw ``CUresult``
code and name; malformed input is a :class:`DescriptorError` or a
:class:`TorchRecordError` (both also ``ValueError``) naming the field.
"""

__all__ = [
    "CudaIpcError",
    "DriverNotFound",
    "DriverError",
    "DescriptorError",
    "TorchRecordError",
    "Unsupported",
]


class CudaIpcError(Exception):
    """Base class of every error raised by cuda_ipc.

    ``call``, ``code`` and ``name`` are set for driver errors and ``None``
    otherwise.
    """

    call = None
    code = None
    name = None


class DriverNotFound(CudaIpcError):
    """libcuda.so.1 could not be loaded or initialised (no NVIDIA driver)."""


class Unsupported(CudaIpcError):
    """This machine, kernel or library cannot do what was asked."""


class DriverError(CudaIpcError):
    """A CUDA driver call failed.

    Attributes: ``call`` (the C function, e.g. ``"cuIpcOpenMemHandle"``),
    ``code`` (the raw ``CUresult``), ``name`` (e.g.
    ``"CUDA_ERROR_INVALID_CONTEXT"``) and ``hint`` (what it usually means, or
    ``None``).
    """

    def __init__(self, call, code, name, hint=None):
        self.call = call
        self.code = int(code)
        self.name = name
        self.hint = hint
        text = f"{call} failed with {name} ({self.code})"
        if hint:
            text += f": {hint}"
        super().__init__(text)


class DescriptorError(CudaIpcError, ValueError):
    """A descriptor field is missing or malformed (the same rules as the Rust
    ``descriptor.rs``)."""

    def __init__(self, field, reason):
        self.field = field
        self.reason = reason
        super().__init__(f"descriptor field `{field}`: {reason}")


class TorchRecordError(CudaIpcError, ValueError):
    """A PyTorch share record is malformed or of an unsupported kind (the same
    rules as the Rust ``torch.rs``)."""

    def __init__(self, reason):
        self.reason = reason
        super().__init__(f"PyTorch share record: {reason}")
