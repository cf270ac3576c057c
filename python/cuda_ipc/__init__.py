"""cuda_ipc: share CUDA memory between processes without copying.

The Rust library cuda-ipc, for Python: map memory another process exported
(a Rust program, the ``cuda-ipc`` command, or another Python process) as a
PyTorch tensor or a CuPy array, export tensors and arrays the other way.

>>> m = cuda_ipc.open(descriptor_json)        # doctest: +SKIP
>>> t = m.as_torch()                          # zero copy (DLPack); keeps the mapping alive
>>> e = cuda_ipc.export_torch(tensor)         # doctest: +SKIP
>>> send(e.json()); wait_for_consumers(); e.close()

Importing loads only the extension module (``cuda_ipc._core``); the driver
(libcuda.so.1) is loaded on first use, torch and cupy by the functions that
use them. ``cuda_ipc.torch.shareable(publisher)`` makes tensors in a
publisher's arena (see :mod:`cuda_ipc.torch`). See docs/PYTHON.md.
"""

from . import _core, dtypes, errors, sets
from .channel import Attachment, Frame, Published, Publisher, Ring, RingPublisher, Subscriber
from .descriptor import FORMAT_VERSION, cuda_array_interface, descriptor_json, parse_descriptor, validate_descriptor
from .errors import (
    Asleep,
    CudaIpcError,
    DescriptorError,
    DriverError,
    DriverInvalidInput,
    DriverNotFound,
    DriverPeerGone,
    DriverTimeout,
    DriverUnavailable,
    Failed,
    InvalidInput,
    MissingDependency,
    NoDevice,
    PeerGone,
    SameProcess,
    ServiceError,
    Timeout,
    TorchRecordError,
    Unavailable,
    Unsupported,
)
from .export import Export, export_cupy, export_torch, torch_share_record
from .mapping import Mapping, live_mappings, open, retiring, settle
from .sets import ArenaBuffer, SetAttachment, StateDict
from . import service
from .torch_record import parse_storage_handle, record_to_descriptor, tensor_layout, validate_record

__version__ = _core.__version__


def __getattr__(name):
    # cuda_ipc.torch (tensors born shareable) on first use: importing it does
    # not import torch either.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


driver_available = _core.driver_available
driver_version = _core.driver_version
device_count = _core.device_count
device_uuid = _core.device_uuid
mem_info = _core.mem_info

__all__ = [
    "Publisher",
    "Subscriber",
    "Published",
    "Attachment",
    "RingPublisher",
    "Ring",
    "Frame",
    "ArenaBuffer",
    "SetAttachment",
    "StateDict",
    "open",
    "Mapping",
    "live_mappings",
    "settle",
    "retiring",
    "export_torch",
    "export_cupy",
    "torch_share_record",
    "Export",
    "validate_descriptor",
    "parse_descriptor",
    "descriptor_json",
    "cuda_array_interface",
    "validate_record",
    "record_to_descriptor",
    "parse_storage_handle",
    "tensor_layout",
    "driver_available",
    "driver_version",
    "device_count",
    "device_uuid",
    "mem_info",
    "dtypes",
    "sets",
    "service",
    "FORMAT_VERSION",
    *errors.__all__,
]


def __dir__():
    # dir(cuda_ipc) shows the API: no implementation modules or imports.
    return sorted([*__all__, "torch", "__version__"])
