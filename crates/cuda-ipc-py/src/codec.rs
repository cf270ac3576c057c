//! Descriptors, PyTorch share records, storage handles and element types:
//! decoded, checked and written by the library's decoders, handed to Python
//! as plain dicts.
//!
//! Documents cross as JSON text: a dict is written with Python's `json`
//! module and read by the library's strict decoder, so Python sees the same
//! rules and the same messages as Rust programs and the command-line tool.

use cuda_ipc::descriptor::{Descriptor, Dtype};
use cuda_ipc::set::SetRecord;
use cuda_ipc::torch::{SegmentHandles, ShareRecord, StorageHandle};
use cuda_ipc::{Error, torch};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyMemoryView, PyString};

use crate::errors::IntoPyResult;

/// The JSON text of a document given as text, bytes or a JSON-able object.
/// `invalid` builds the error for input that cannot be a document.
pub(crate) fn document_text(
    obj: &Bound<'_, PyAny>,
    invalid: fn(String) -> Error,
) -> PyResult<String> {
    if obj.is_instance_of::<PyString>() {
        return obj.extract();
    }
    let raw: Option<Vec<u8>> = if let Ok(b) = obj.cast::<PyBytes>() {
        Some(b.as_bytes().to_vec())
    } else if let Ok(b) = obj.cast::<PyByteArray>() {
        Some(b.to_vec())
    } else {
        None
    };
    if let Some(raw) = raw {
        return String::from_utf8(raw)
            .map_err(|e| invalid(format!("the bytes are not UTF-8 text ({e})")))
            .py();
    }
    let json = obj.py().import("json")?;
    match json.call_method1("dumps", (obj,)) {
        Ok(text) => Ok(text.extract()?),
        Err(e) => Err(invalid(format!(
            "a {} cannot be written as JSON ({e}); give a dict, JSON text or bytes",
            obj.get_type().name()?
        )))
        .py(),
    }
}

/// JSON text as Python objects (`json.loads`).
pub(crate) fn loads<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (text,))
}

fn descriptor_input(reason: String) -> Error {
    Error::Descriptor {
        field: "(document)".into(),
        reason,
    }
}

#[allow(clippy::needless_pass_by_value)] // a `fn(String) -> Error` for `document_text`
fn record_input(reason: String) -> Error {
    Error::Torch(format!("field `(document)`: {reason}"))
}

/// Decodes and checks a descriptor given as a dict, JSON text or bytes.
pub(crate) fn descriptor_of(obj: &Bound<'_, PyAny>) -> PyResult<Descriptor> {
    let text = document_text(obj, descriptor_input)?;
    Descriptor::from_json(&text).py()
}

/// Decodes and checks a share record given as a dict, JSON text or bytes.
pub(crate) fn record_of(obj: &Bound<'_, PyAny>) -> PyResult<ShareRecord> {
    let text = document_text(obj, record_input)?;
    ShareRecord::from_json(&text).py()
}

/// A descriptor as a dict, in the library's canonical form.
pub(crate) fn descriptor_dict<'py>(py: Python<'py>, d: &Descriptor) -> PyResult<Bound<'py, PyAny>> {
    loads(py, &d.to_json())
}

/// Checks a descriptor (a dict, JSON text or bytes) with the library's
/// decoder and returns it as a dict in canonical form: lower-case hex,
/// `elem_size` filled in, absent optional fields left out.
#[pyfunction]
pub(crate) fn parse_descriptor<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let d = descriptor_of(obj)?;
    descriptor_dict(obj.py(), &d)
}

/// A descriptor's canonical JSON text (one line).
#[pyfunction]
pub(crate) fn descriptor_json(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(descriptor_of(obj)?.to_json())
}

/// Whether a dict is a PyTorch share record (it has the `torch_share` key).
#[pyfunction]
pub(crate) fn is_record(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    match obj.cast::<PyDict>() {
        Ok(d) => d.contains(torch::RECORD_KEY),
        Err(_) => Ok(false),
    }
}

/// Checks a PyTorch share record and returns it in canonical form.
#[pyfunction]
pub(crate) fn validate_record<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let r = record_of(obj)?;
    loads(obj.py(), &r.to_json())
}

/// The descriptor of a share record (one allocation: a `cudaMalloc` block,
/// or an expandable segment of one physical allocation).
#[pyfunction]
pub(crate) fn record_to_descriptor<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let d = record_of(obj)?.to_descriptor().py()?;
    descriptor_dict(obj.py(), &d)
}

/// Where a record's tensor lies in its shared memory:
/// `{"offset", "len", "dtype", "shape", "strides"}` (strides `None` when
/// contiguous row-major).
#[pyfunction]
pub(crate) fn tensor_layout<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
    let py = obj.py();
    let l = record_of(obj)?.tensor_layout().py()?;
    let out = PyDict::new(py);
    out.set_item("offset", l.offset)?;
    out.set_item("len", l.byte_len)?;
    out.set_item("dtype", l.dtype.name())?;
    out.set_item("shape", l.shape)?;
    out.set_item("strides", l.strides)?;
    Ok(out)
}

/// The bytes of a storage handle given as bytes, a bytearray, a memoryview
/// (anything with the buffer protocol), or hex text (as a share record's
/// `storage_handle` field holds it).
fn storage_handle_bytes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(text) = obj.cast::<PyString>() {
        let text = text.to_cow()?;
        return hex::decode(text.trim())
            .map_err(|e| {
                Error::Torch(format!(
                    "storage handle {}: the text is not hex ({e}); give the bytes of \
                     `storage._share_cuda_()[1]` or their hex",
                    cuda_ipc::units::shorten(&text, 40)
                ))
            })
            .py();
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<PyByteArray>() {
        return Ok(b.to_vec());
    }
    if obj.is_instance_of::<PyMemoryView>() {
        let b = obj.call_method0("tobytes")?;
        return Ok(b.cast::<PyBytes>()?.as_bytes().to_vec());
    }
    let kind = obj.get_type().name()?;
    Err(Error::Torch(format!(
        "a storage handle is bytes (`storage._share_cuda_()[1]`) or their hex, not a {kind}"
    )))
    .py()
}

/// Decodes a storage handle (`storage._share_cuda_()[1]`: bytes, or their
/// hex): `{"type": "c", "version", "handle": bytes}` or `{"type": "e",
/// "version", "pid", "segment_size", "kind": "fd" | "fabric", "handles": [...]}`.
#[pyfunction]
pub(crate) fn parse_storage_handle<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    let data = storage_handle_bytes(data)?;
    let out = PyDict::new(py);
    match StorageHandle::parse(&data).py()? {
        StorageHandle::CudaMalloc { version, handle } => {
            out.set_item("type", "c")?;
            out.set_item("version", version)?;
            out.set_item("handle", PyBytes::new(py, &raw(&handle.to_string())))?;
        }
        StorageHandle::Expandable { version, segment } => {
            out.set_item("type", "e")?;
            out.set_item("version", version)?;
            out.set_item("pid", segment.pid)?;
            out.set_item("segment_size", segment.segment_size)?;
            let handles = PyList::empty(py);
            match &segment.handles {
                SegmentHandles::PosixFds(fds) => {
                    out.set_item("kind", "fd")?;
                    for fd in fds {
                        handles.append(fd)?;
                    }
                }
                SegmentHandles::Fabric(hs) => {
                    out.set_item("kind", "fabric")?;
                    for h in hs {
                        handles.append(PyBytes::new(py, &raw(&h.to_string())))?;
                    }
                }
                other => {
                    return Err(Error::Torch(format!(
                        "storage handle with {} {}, which this build cannot describe",
                        other.len(),
                        other.kind()
                    )))
                    .py();
                }
            }
            out.set_item("handles", handles)?;
        }
        _ => {
            return Err(Error::Torch(
                "a storage handle of a kind this build cannot describe".into(),
            ))
            .py();
        }
    }
    Ok(out)
}

fn set_input(reason: String) -> Error {
    Error::Descriptor {
        field: "(set record)".into(),
        reason,
    }
}

/// Checks a set record (the weights of a model in the chunks of one arena;
/// a dict, JSON text or bytes, format 1 or 2) and returns it in format 1,
/// every entry a list `[name, dtype, shape, chunk, offset, len]`, to read.
#[pyfunction]
pub(crate) fn parse_set_record<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let text = document_text(obj, set_input)?;
    let r = SetRecord::from_json(&text).py()?;
    loads(obj.py(), &r.to_expanded_value().to_string())
}

/// The descriptor of entry `index` of a set record: its bytes in its chunk,
/// with the entry's element type and shape (and the set's event).
#[pyfunction]
pub(crate) fn set_entry_descriptor<'py>(
    obj: &Bound<'py, PyAny>,
    index: crate::args::Index,
) -> PyResult<Bound<'py, PyAny>> {
    let index = index.0;
    let text = document_text(obj, set_input)?;
    let d = SetRecord::from_json(&text)
        .and_then(|r| r.entry_descriptor(index))
        .py()?;
    descriptor_dict(obj.py(), &d)
}

/// The bytes of a handle's hex text (the handle types keep their bytes private).
fn raw(hex_text: &str) -> Vec<u8> {
    hex::decode(hex_text).unwrap_or_default()
}

/// The NumPy name and the CUDA array interface type string of an element
/// type. Types NumPy lacks have the name `ml_dtypes` gives them and a
/// type string of raw bytes of their size (`|V1`, `<V2`), as CUDA array
/// interface consumers read them; `float4_e2m1fn_x2` (two fp4 values a
/// byte) is PyTorch's name: `ml_dtypes` has no packed fp4.
fn numpy_of(d: Dtype) -> (&'static str, &'static str) {
    match d {
        Dtype::Bool => ("bool", "|b1"),
        Dtype::U8 => ("uint8", "|u1"),
        Dtype::I8 => ("int8", "|i1"),
        Dtype::U16 => ("uint16", "<u2"),
        Dtype::I16 => ("int16", "<i2"),
        Dtype::U32 => ("uint32", "<u4"),
        Dtype::I32 => ("int32", "<i4"),
        Dtype::U64 => ("uint64", "<u8"),
        Dtype::I64 => ("int64", "<i8"),
        Dtype::F16 => ("float16", "<f2"),
        Dtype::Bf16 => ("bfloat16", "<V2"),
        Dtype::F32 => ("float32", "<f4"),
        Dtype::F64 => ("float64", "<f8"),
        Dtype::F8E4m3fn => ("float8_e4m3fn", "|V1"),
        Dtype::F8E5m2 => ("float8_e5m2", "|V1"),
        Dtype::F8E4m3fnuz => ("float8_e4m3fnuz", "|V1"),
        Dtype::F8E5m2fnuz => ("float8_e5m2fnuz", "|V1"),
        Dtype::F8E8m0fnu => ("float8_e8m0fnu", "|V1"),
        Dtype::F4E2m1fnX2 => ("float4_e2m1fn_x2", "|V1"),
        Dtype::C64 => ("complex64", "<c8"),
        Dtype::C128 => ("complex128", "<c16"),
        // A type added to the library later: raw bytes under its own name.
        other => (other.name(), bytes_typestr(other.size())),
    }
}

/// The type string of `size` raw bytes. Element sizes are 1, 2, 4, 8 or 16
/// bytes (the library's tests/dtypes.rs holds it to that).
fn bytes_typestr(size: u64) -> &'static str {
    match size {
        1 => "|V1",
        2 => "<V2",
        4 => "<V4",
        8 => "<V8",
        _ => "|V16",
    }
}

/// The type a `raw` view shows: [`Dtype::raw`], the same-sized integer
/// every consumer can build (`u8` for bool and the fp8/fp4 types); `c128`,
/// which has no 16-byte integer, stays itself.
pub(crate) fn raw_dtype(d: Dtype) -> Dtype {
    d.raw().unwrap_or(d)
}

/// The CUDA array interface type string of an element type.
pub(crate) fn typestr(d: Dtype) -> &'static str {
    numpy_of(d).1
}

/// The type string of a `raw` view: the same-sized integer's, or raw bytes
/// (`|V16` for `c128`).
pub(crate) fn raw_typestr(d: Dtype) -> &'static str {
    match d.raw() {
        Some(r) => typestr(r),
        None => bytes_typestr(d.size()),
    }
}

/// The NumPy name of a `raw` view's elements (NumPy's name of raw bytes,
/// `void128`, for `c128`).
fn raw_numpy(d: Dtype) -> &'static str {
    match (d.raw(), d.size()) {
        (Some(r), _) => numpy_of(r).0,
        (None, 1) => "void8",
        (None, 2) => "void16",
        (None, 4) => "void32",
        (None, 8) => "void64",
        (None, _) => "void128",
    }
}

/// Every element type: `(name, torch, numpy, typestr, size, raw_typestr,
/// raw_numpy, raw)`, in the library's order; `raw` is the descriptor name
/// of the type a `raw` view shows ([`raw_dtype`]).
#[pyfunction]
#[allow(clippy::type_complexity)] // one row of a table, read by position in Python
pub(crate) fn dtype_table() -> Vec<(
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    u64,
    &'static str,
    &'static str,
    &'static str,
)> {
    Dtype::ALL
        .iter()
        .map(|&d| {
            let (numpy, ts) = numpy_of(d);
            (
                d.name(),
                torch::torch_dtype_name(d),
                numpy,
                ts,
                d.size(),
                raw_typestr(d),
                raw_numpy(d),
                raw_dtype(d).name(),
            )
        })
        .collect()
}

/// The descriptor element type of a PyTorch dtype name (`"float32"` or
/// `"torch.float32"`), with the library's message for types that cannot be
/// shared.
#[pyfunction]
pub(crate) fn dtype_from_torch(name: &str) -> PyResult<&'static str> {
    let name = name.strip_prefix("torch.").unwrap_or(name);
    Ok(torch::dtype_from_torch(name).py()?.name())
}

/// Registers this module's functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(parse_descriptor, m)?)?;
    m.add_function(wrap_pyfunction!(descriptor_json, m)?)?;
    m.add_function(wrap_pyfunction!(is_record, m)?)?;
    m.add_function(wrap_pyfunction!(validate_record, m)?)?;
    m.add_function(wrap_pyfunction!(record_to_descriptor, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_layout, m)?)?;
    m.add_function(wrap_pyfunction!(parse_storage_handle, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_table, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_from_torch, m)?)?;
    m.add_function(wrap_pyfunction!(parse_set_record, m)?)?;
    m.add_function(wrap_pyfunction!(set_entry_descriptor, m)?)?;
    m.add("FORMAT_VERSION", cuda_ipc::descriptor::FORMAT_VERSION)?;
    m.add("RECORD_KEY", torch::RECORD_KEY)?;
    Ok(())
}
