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
            out.set_item("handle", PyBytes::new(py, &raw(&handle.to_hex())))?;
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
                        handles.append(PyBytes::new(py, &raw(&h.to_hex())))?;
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
    index: usize,
) -> PyResult<Bound<'py, PyAny>> {
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

/// The NumPy name, the CUDA array interface type string, and a same-sized
/// integer type (string and NumPy name) every consumer can build.
fn numpy_names(d: Dtype) -> (&'static str, &'static str, &'static str, &'static str) {
    match d {
        Dtype::Bool => ("bool", "|b1", "|u1", "uint8"),
        Dtype::U8 => ("uint8", "|u1", "|u1", "uint8"),
        Dtype::I8 => ("int8", "|i1", "|i1", "int8"),
        Dtype::U16 => ("uint16", "<u2", "<i2", "int16"),
        Dtype::I16 => ("int16", "<i2", "<i2", "int16"),
        Dtype::U32 => ("uint32", "<u4", "<i4", "int32"),
        Dtype::I32 => ("int32", "<i4", "<i4", "int32"),
        Dtype::U64 => ("uint64", "<u8", "<i8", "int64"),
        Dtype::I64 => ("int64", "<i8", "<i8", "int64"),
        Dtype::F16 => ("float16", "<f2", "<i2", "int16"),
        // No NumPy type string: two raw bytes.
        Dtype::Bf16 => ("bfloat16", "<V2", "<i2", "int16"),
        Dtype::F32 => ("float32", "<f4", "<i4", "int32"),
        Dtype::F64 => ("float64", "<f8", "<i8", "int64"),
        // A type added to the library later: its raw bytes.
        other => match other.size() {
            1 => ("uint8", "|u1", "|u1", "uint8"),
            2 => ("int16", "<i2", "<i2", "int16"),
            4 => ("int32", "<i4", "<i4", "int32"),
            _ => ("int64", "<i8", "<i8", "int64"),
        },
    }
}

/// The CUDA array interface type string of an element type.
pub(crate) fn typestr(d: Dtype) -> &'static str {
    numpy_names(d).1
}

/// The same-sized integer type string of an element type.
pub(crate) fn raw_typestr(d: Dtype) -> &'static str {
    numpy_names(d).2
}

/// Every element type: `(name, torch, numpy, typestr, size, raw_typestr,
/// raw_numpy)`, in the library's order.
#[pyfunction]
pub(crate) fn dtype_table() -> Vec<(
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    u64,
    &'static str,
    &'static str,
)> {
    Dtype::ALL
        .iter()
        .map(|&d| {
            let (numpy, ts, raw_ts, raw_np) = numpy_names(d);
            (
                d.name(),
                torch::torch_dtype_name(d),
                numpy,
                ts,
                d.size(),
                raw_ts,
                raw_np,
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
