"""Element types: descriptor names, PyTorch names, NumPy names, CUDA array
interface type strings.

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

bfloat16 has no NumPy type string; the CUDA array interface of a bf16
mapping says ``<V2`` (two raw bytes), and ``as_torch()`` builds the tensor
from the 16-bit integers and reinterprets them as ``torch.bfloat16``.
"""

__all__ = ["DTYPES", "DType", "by_name", "from_torch", "from_numpy_name", "torch_name"]


class DType:
    """One element type."""

    __slots__ = ("name", "torch", "numpy", "typestr", "size", "raw_typestr", "raw_numpy")

    def __init__(self, name, torch, numpy, typestr, size, raw_typestr, raw_numpy):
        self.name = name  # in descriptors
        self.torch = torch  # torch.<torch>
        self.numpy = numpy  # numpy / cupy name
        self.typestr = typestr  # __cuda_array_interface__ typestr
        self.size = size
        # A same-sized type every CAI consumer can build (for reinterpretation).
        self.raw_typestr = raw_typestr
        self.raw_numpy = raw_numpy

    def __repr__(self):
        return f"DType({self.name!r})"


DTYPES = [
    DType("bool", "bool", "bool", "|b1", 1, "|u1", "uint8"),
    DType("u8", "uint8", "uint8", "|u1", 1, "|u1", "uint8"),
    DType("i8", "int8", "int8", "|i1", 1, "|i1", "int8"),
    DType("u16", "uint16", "uint16", "<u2", 2, "<i2", "int16"),
    DType("i16", "int16", "int16", "<i2", 2, "<i2", "int16"),
    DType("u32", "uint32", "uint32", "<u4", 4, "<i4", "int32"),
    DType("i32", "int32", "int32", "<i4", 4, "<i4", "int32"),
    DType("u64", "uint64", "uint64", "<u8", 8, "<i8", "int64"),
    DType("i64", "int64", "int64", "<i8", 8, "<i8", "int64"),
    DType("f16", "float16", "float16", "<f2", 2, "<i2", "int16"),
    DType("bf16", "bfloat16", "bfloat16", "<V2", 2, "<i2", "int16"),
    DType("f32", "float32", "float32", "<f4", 4, "<i4", "int32"),
    DType("f64", "float64", "float64", "<f8", 8, "<i8", "int64"),
]

_BY_NAME = {d.name: d for d in DTYPES}
_BY_TORCH = {d.torch: d for d in DTYPES}
_BY_NUMPY = {d.numpy: d for d in DTYPES}


def names():
    """Every descriptor dtype name, in table order."""
    return [d.name for d in DTYPES]


def by_name(name):
    """The DType of a descriptor name (``"f32"``), or ``None``."""
    return _BY_NAME.get(name)


def from_torch(name):
    """The DType of a PyTorch dtype name (``"float32"``, no ``torch.``
    prefix), or ``None``."""
    return _BY_TORCH.get(name)


def torch_name(dtype):
    """The PyTorch name of a torch.dtype object (``torch.float32`` ->
    ``"float32"``)."""
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


def from_numpy_name(name):
    """The DType of a NumPy/CuPy dtype name (``"float32"``, ``"bfloat16"``),
    or ``None``."""
    return _BY_NUMPY.get(name)


def lookup(name):
    """The DType for any accepted spelling: a descriptor name (``"u16"``), a
    PyTorch/NumPy name (``"uint16"``), or a torch/numpy dtype object."""
    if isinstance(name, DType):
        return name
    text = torch_name(name)
    if text in _BY_NAME:
        return _BY_NAME[text]
    if text in _BY_TORCH:
        return _BY_TORCH[text]
    return None
