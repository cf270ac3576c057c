"""cuda_ipc: share CUDA memory between processes without copying.

Map memory another process exported (a Rust program using the cuda-ipc
crate, the ``cuda-ipc export`` command, or another Python process) as a
PyTorch tensor or a CuPy array, and export tensors and arrays the other way.

>>> m = cuda_ipc.open(descriptor_json)        # doctest: +SKIP
>>> t = m.as_torch()                          # zero copy; keeps the mapping alive
>>> e = cuda_ipc.export_torch(tensor)         # doctest: +SKIP
>>> send(e.json()); wait_for_consumers(); e.close()

Only the standard library is imported here (ctypes on libcuda.so.1, loaded on
first use); torch and cupy are imported by the functions that use them.
See docs/PYTHON.md.
"""

from . import dtypes
from ._driver import available as driver_available
from .descriptor import FORMAT_VERSION, cuda_array_interface, parse_descriptor, validate_descriptor
from .errors import CudaIpcError, DescriptorError, DriverError, DriverNotFound, TorchRecordError, Unsupported
from .export import Export, MissingDependency, export_cupy, export_torch, torch_share_record
from .mapping import Mapping, live_mappings, open
from .torch_record import parse_storage_handle, record_to_descriptor, tensor_layout, validate_record

__version__ = "0.1.0"

__all__ = [
    "open",
    "Mapping",
    "live_mappings",
    "export_torch",
    "export_cupy",
    "torch_share_record",
    "Export",
    "validate_descriptor",
    "parse_descriptor",
    "cuda_array_interface",
    "validate_record",
    "record_to_descriptor",
    "parse_storage_handle",
    "tensor_layout",
    "driver_available",
    "dtypes",
    "FORMAT_VERSION",
    "CudaIpcError",
    "MissingDependency",
    "DriverError",
    "DriverNotFound",
    "DescriptorError",
    "TorchRecordError",
    "Unsupported",
]
