"""Element types: descriptor names, PyTorch names, NumPy names, CUDA array
interface type strings (the table is the extension's, from the Rust library).

| descriptor | PyTorch | NumPy / CuPy | typestr | bytes |
|---|---|---|---|---|
| bool | bool | bool | ``|b1`` | 1 |
| u8 | uint8 | uint8 | ``|u1`` | 1 |
| i8 | int8 | int8 | ``|i1`` | 1 |
| u16 | uint16 | uint16 | ``<u2`` | 2 |
| i16 | int16 | int16 | ``<i2`` | 2 |
| u32 | uint32 | uint32 | ``<u4`` | 4 |
| i32 | int32 | int32 | ``<i4`` | 4 |
| u64 | uint64 | uint64 | ``<u8`` | 8 |
| i64 | int64 | int64 | ``<i8`` | 8 |
| f16 | float16 | float16 | ``<f2`` | 2 |
| bf16 | bfloat16 | bfloat16 (ml_dtypes) | ``<V2`` | 2 |
| f32 | float32 | float32 | ``<f4`` | 4 |
| f64 | float64 | float64 | ``<f8`` | 8 |
"""

from . import _core

__all__ = ["DTYPES", "DType", "by_name", "from_torch", "from_numpy_name", "torch_name", "names", "lookup"]


class DType:
    """One element type: ``name`` (in descriptors), ``torch``, ``numpy``,
    ``typestr``, ``size``, and ``raw_typestr``/``raw_numpy`` (a same-sized
    integer type every consumer can build)."""

    __slots__ = ("name", "torch", "numpy", "typestr", "size", "raw_typestr", "raw_numpy")

    def __init__(self, name, torch, numpy, typestr, size, raw_typestr, raw_numpy):
        self.name, self.torch, self.numpy, self.typestr = name, torch, numpy, typestr
        self.size, self.raw_typestr, self.raw_numpy = size, raw_typestr, raw_numpy

    def __repr__(self):
        return f"DType({self.name!r})"


DTYPES = [DType(*row) for row in _core.dtype_table()]
_BY_NAME = {d.name: d for d in DTYPES}
_BY_TORCH = {d.torch: d for d in DTYPES}
_BY_NUMPY = {d.numpy: d for d in DTYPES}


def names():
    """Every descriptor dtype name, in table order."""
    return [d.name for d in DTYPES]


def by_name(name):
    """The :class:`DType` of a descriptor name (``"f32"``), or ``None``."""
    return _BY_NAME.get(name)


def from_torch(name):
    """The :class:`DType` of a PyTorch dtype name (``"float32"``), or ``None``."""
    return _BY_TORCH.get(torch_name(name))


def torch_name(dtype):
    """``"float32"`` for ``torch.float32`` (or its string)."""
    return str(dtype).replace("torch.", "")


def from_numpy_name(name):
    """The :class:`DType` of a NumPy/CuPy dtype name, or ``None``."""
    return _BY_NUMPY.get(name)


def lookup(name):
    """The :class:`DType` of a descriptor, PyTorch or NumPy name, or ``None``."""
    if isinstance(name, DType):
        return name
    name = torch_name(name)
    return _BY_NAME.get(name) or _BY_TORCH.get(name) or _BY_NUMPY.get(name)
