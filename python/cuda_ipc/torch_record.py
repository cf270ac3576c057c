"""PyTorch share records (``storage._share_cuda_()`` and ``reduce_tensor``'s
arguments as language-neutral JSON): decoded and converted by the Rust
library (``cuda_ipc::torch::ShareRecord``)."""

from . import _core

__all__ = ["is_record", "validate_record", "record_to_descriptor", "record_to_json", "tensor_layout",
           "parse_storage_handle"]


def __dir__():
    # dir() shows the module's API, not its imports and helpers.
    return sorted(__all__)


def is_record(obj):
    """Whether ``obj`` is a share record (a dict with the ``torch_share`` key)."""
    return _core.is_record(obj)


def validate_record(record):
    """Checks a record (dict, JSON text or bytes); returns it in canonical form."""
    return _core.validate_record(record)


def record_to_json(record):
    """A record as canonical JSON-ready dict (the same as :func:`validate_record`)."""
    return _core.validate_record(record)


def record_to_descriptor(record):
    """The descriptor of a record's tensor (one allocation)."""
    return _core.record_to_descriptor(record)


# What a layout does not depend on, for partial records (the layout fields only).
_LAYOUT_DEFAULTS = {
    "torch_share": 1,
    "storage_handle": "0263" + "01" * 64,
    "storage_device": 0,
    "device_uuid": "GPU-00000000-0000-0000-0000-000000000000",
    "pid": 1,
    "requires_grad": False,
    "event_sync_required": False,
}


def tensor_layout(record):
    """``{"offset", "len", "dtype", "shape", "strides"}`` of a record's tensor
    in its shared memory (``strides`` ``None`` when contiguous). Only the
    layout fields are needed (``tensor_size``, ``tensor_stride``,
    ``tensor_offset``, ``storage_size_bytes``, ``storage_offset_bytes``,
    ``dtype``)."""
    if isinstance(record, dict):
        record = {**_LAYOUT_DEFAULTS, **record}
    return _core.tensor_layout(record)


def parse_storage_handle(data):
    """Decodes a storage handle (bytes, or their hex as a record holds them):
    ``{"type": "c", "version", "handle"}`` or ``{"type": "e", "version",
    "pid", "segment_size", "kind", "handles"}``."""
    return _core.parse_storage_handle(data)
