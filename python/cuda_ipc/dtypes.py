"""Element types: descriptor names, PyTorch names, NumPy names, CUDA array
interface type strings (the table is the extension's, from the Rust library).

| descriptor | PyTorch | NumPy / CuPy | typestr | bytes | raw |
|---|---|---|---|---|---|
| bool | bool | bool | ``|b1`` | 1 | u8 |
| u8 | uint8 | uint8 | ``|u1`` | 1 | u8 |
| i8 | int8 | int8 | ``|i1`` | 1 | i8 |
| u16 | uint16 | uint16 | ``<u2`` | 2 | i16 |
| i16 | int16 | int16 | ``<i2`` | 2 | i16 |
| u32 | uint32 | uint32 | ``<u4`` | 4 | i32 |
| i32 | int32 | int32 | ``<i4`` | 4 | i32 |
| u64 | uint64 | uint64 | ``<u8`` | 8 | i64 |
| i64 | int64 | int64 | ``<i8`` | 8 | i64 |
| f16 | float16 | float16 | ``<f2`` | 2 | i16 |
| bf16 | bfloat16 | bfloat16 (ml_dtypes) | ``<V2`` | 2 | i16 |
| f32 | float32 | float32 | ``<f4`` | 4 | i32 |
| f64 | float64 | float64 | ``<f8`` | 8 | i64 |
| f8e4m3fn | float8_e4m3fn | float8_e4m3fn (ml_dtypes) | ``|V1`` | 1 | u8 |
| f8e5m2 | float8_e5m2 | float8_e5m2 (ml_dtypes) | ``|V1`` | 1 | u8 |
| f8e4m3fnuz | float8_e4m3fnuz | float8_e4m3fnuz (ml_dtypes) | ``|V1`` | 1 | u8 |
| f8e5m2fnuz | float8_e5m2fnuz | float8_e5m2fnuz (ml_dtypes) | ``|V1`` | 1 | u8 |
| f8e8m0fnu | float8_e8m0fnu | float8_e8m0fnu (ml_dtypes) | ``|V1`` | 1 | u8 |
| f4e2m1fnx2 | float4_e2m1fn_x2 | (none: two fp4 values a byte) | ``|V1`` | 1 | u8 |
| c64 | complex64 | complex64 | ``<c8`` | 8 | i64 |
| c128 | complex128 | complex128 | ``<c16`` | 16 | c128 (raw typestr ``|V16``) |

``raw`` is the same-sized integer type a ``raw`` view shows, for readers
that cannot build the type (``raw_typestr``, ``raw_numpy``); complex128
has no 16-byte integer, so its raw view stays complex in DLPack and is
``|V16`` bytes in the CUDA array interface.

The fp8 and fp4 types travel as their bits: :meth:`as_torch` and
``attach_state_dict`` give the same PyTorch dtype back, :meth:`as_cupy`
gives their bits as ``uint8`` (CuPy has no fp8 type), and Rust reads them
as bytes (``SetAttachment::view::<u8>``) with the name in the entry. An
element is a byte for ``float4_e2m1fn_x2`` (two values), as in PyTorch.

PyTorch types without a row (the sub-byte ``uint1``..``uint7`` and
``int1``..``int7``, quantized types, ``complex32``) are refused, naming the
type: view such a tensor as bytes first (``t.view(torch.uint8)``) and view
the bytes back after reading. Readers built before the fp8, fp4 and complex
rows refuse descriptors and set records that use them.
"""

from . import _core

__all__ = ["DTYPES", "DType", "by_name", "from_torch", "from_numpy_name", "torch_name", "names", "lookup",
           "raw_name"]


def __dir__():
    # dir() shows the module's API, not its imports and helpers.
    return sorted(__all__)


class DType:
    """One element type: ``name`` (in descriptors), ``torch``, ``numpy``,
    ``typestr``, ``size``, and ``raw_typestr``/``raw_numpy``/``raw`` (the
    same-sized integer type every consumer can build, and its descriptor
    name)."""

    __slots__ = ("name", "torch", "numpy", "typestr", "size", "raw_typestr", "raw_numpy", "raw")

    def __init__(self, name, torch, numpy, typestr, size, raw_typestr, raw_numpy, raw):
        self.name, self.torch, self.numpy, self.typestr = name, torch, numpy, typestr
        self.size, self.raw_typestr, self.raw_numpy, self.raw = size, raw_typestr, raw_numpy, raw

    def __repr__(self):
        return f"DType({self.name!r})"


DTYPES = [DType(*row) for row in _core.dtype_table()]

# The one-byte types no NumPy, CuPy or older DLPack consumer builds (fp8,
# packed fp4: raw bytes in the CUDA array interface): handed over as their
# bits (uint8) and, for PyTorch, viewed back as the type.
BITS_ONLY = frozenset(d.name for d in DTYPES if d.size == 1 and d.typestr.startswith("|V"))
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


def raw_name(name, raw=True):
    """The descriptor name of the same-sized integer a ``raw`` view of
    descriptor type ``name`` shows (``"bf16"`` -> ``"i16"``,
    ``"f8e4m3fn"`` -> ``"u8"``); ``name`` itself when ``raw`` is false or
    the name is unknown."""
    if not raw:
        return name
    d = _BY_NAME.get(name)
    return d.raw if d is not None else name
