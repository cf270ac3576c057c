//! The descriptor: a versioned, language-neutral JSON record of one export.
//!
//! A descriptor says how the memory is shared (the mechanism and its handle
//! or file descriptor), which bytes of the allocation are meant (offset and
//! length), what they hold (element type, optional shape and strides), where
//! they live (device UUID) and who exported them (process id). Scripts in
//! any language can read and write it; `cuda-ipc export` prints one and
//! `cuda-ipc open` takes one.
//!
//! ```json
//! {"cuda_ipc":1,"mechanism":"legacy","handle":"<128 hex digits>",
//!  "alloc_size":2097152,"offset":0,"len":4096,"dtype":"u32","elem_size":4,
//!  "device_uuid":"GPU-...","pid":4242}
//! ```
//!
//! Decoding is strict: unknown fields, wrong types, negative or fractional
//! numbers, inconsistent sizes and fields that do not belong to the
//! mechanism are all errors that name the field.

use std::fmt;
use std::str::FromStr;

use serde_json::{Map, Value};

use crate::json::{Fields, kind_of};

use crate::device::DeviceUuid;
use crate::error::{Error, Result};
use crate::handle::{FabricHandle, IpcEventHandle, IpcMemHandle, PoolPtrHandle};
pub use crate::mechanism::Mechanism;

/// The descriptor format this build writes and reads.
pub const FORMAT_VERSION: u64 = 1;

/// The key that carries the format version.
pub const VERSION_KEY: &str = "cuda_ipc";

/// The element type of shared memory.
///
/// | name | PyTorch | bytes | what it is |
/// |---|---|---|---|
/// | `bool` | `bool` | 1 | |
/// | `u8` `i8` ... `u64` `i64` | `uint8` ... `int64` | 1-8 | integers |
/// | `f16` `bf16` `f32` `f64` | `float16` `bfloat16` `float32` `float64` | 2-8 | floats |
/// | `f8e4m3fn` | `float8_e4m3fn` | 1 | fp8, 4 exponent and 3 mantissa bits, no infinities |
/// | `f8e5m2` | `float8_e5m2` | 1 | fp8, 5 exponent and 2 mantissa bits |
/// | `f8e4m3fnuz` | `float8_e4m3fnuz` | 1 | fp8 e4m3, no infinities, no negative zero |
/// | `f8e5m2fnuz` | `float8_e5m2fnuz` | 1 | fp8 e5m2, no infinities, no negative zero |
/// | `f8e8m0fnu` | `float8_e8m0fnu` | 1 | an 8-bit power of two (MX block scales) |
/// | `f4e2m1fnx2` | `float4_e2m1fn_x2` | 1 | two fp4 values packed in each byte |
/// | `c64` | `complex64` | 8 | two `f32` (real, imaginary) |
/// | `c128` | `complex128` | 16 | two `f64` (real, imaginary) |
///
/// The names follow the `f16`/`bf16` pattern: kind letter, bits, then the
/// format's suffix without underscores. An element is what the shape
/// counts: one byte (two fp4 values) for `f4e2m1fnx2`, as in PyTorch.
/// Readers older than the fp8, fp4 and complex types refuse descriptors
/// and set records that carry them (the name is unknown to them), naming
/// the field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // the names say it, the table above the rest
#[non_exhaustive]
pub enum Dtype {
    Bool,
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F16,
    Bf16,
    F32,
    F64,
    F8E4m3fn,
    F8E5m2,
    F8E4m3fnuz,
    F8E5m2fnuz,
    F8E8m0fnu,
    F4E2m1fnX2,
    C64,
    C128,
}

crate::json::read::field_from_str!(Dtype);

impl Dtype {
    /// The PyTorch name of this element type (`torch.float32` is `"float32"`).
    pub fn torch_name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::U8 => "uint8",
            Dtype::I8 => "int8",
            Dtype::U16 => "uint16",
            Dtype::I16 => "int16",
            Dtype::U32 => "uint32",
            Dtype::I32 => "int32",
            Dtype::U64 => "uint64",
            Dtype::I64 => "int64",
            Dtype::F16 => "float16",
            Dtype::Bf16 => "bfloat16",
            Dtype::F32 => "float32",
            Dtype::F64 => "float64",
            Dtype::F8E4m3fn => "float8_e4m3fn",
            Dtype::F8E5m2 => "float8_e5m2",
            Dtype::F8E4m3fnuz => "float8_e4m3fnuz",
            Dtype::F8E5m2fnuz => "float8_e5m2fnuz",
            Dtype::F8E8m0fnu => "float8_e8m0fnu",
            Dtype::F4E2m1fnX2 => "float4_e2m1fn_x2",
            Dtype::C64 => "complex64",
            Dtype::C128 => "complex128",
        }
    }

    /// Every element type.
    pub const ALL: [Dtype; 21] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::U16,
        Dtype::I16,
        Dtype::U32,
        Dtype::I32,
        Dtype::U64,
        Dtype::I64,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::F32,
        Dtype::F64,
        Dtype::F8E4m3fn,
        Dtype::F8E5m2,
        Dtype::F8E4m3fnuz,
        Dtype::F8E5m2fnuz,
        Dtype::F8E8m0fnu,
        Dtype::F4E2m1fnX2,
        Dtype::C64,
        Dtype::C128,
    ];

    /// The name in descriptors.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::U8 => "u8",
            Dtype::I8 => "i8",
            Dtype::U16 => "u16",
            Dtype::I16 => "i16",
            Dtype::U32 => "u32",
            Dtype::I32 => "i32",
            Dtype::U64 => "u64",
            Dtype::I64 => "i64",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
            Dtype::F64 => "f64",
            Dtype::F8E4m3fn => "f8e4m3fn",
            Dtype::F8E5m2 => "f8e5m2",
            Dtype::F8E4m3fnuz => "f8e4m3fnuz",
            Dtype::F8E5m2fnuz => "f8e5m2fnuz",
            Dtype::F8E8m0fnu => "f8e8m0fnu",
            Dtype::F4E2m1fnX2 => "f4e2m1fnx2",
            Dtype::C64 => "c64",
            Dtype::C128 => "c128",
        }
    }

    /// Size of one element in bytes.
    pub fn size(self) -> u64 {
        match self {
            Dtype::Bool
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8E4m3fn
            | Dtype::F8E5m2
            | Dtype::F8E4m3fnuz
            | Dtype::F8E5m2fnuz
            | Dtype::F8E8m0fnu
            | Dtype::F4E2m1fnX2 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 | Dtype::C64 => 8,
            Dtype::C128 => 16,
        }
    }

    /// The plain integer type of the same size whose values are this
    /// type's bits, for readers that cannot build the type itself: `u8`
    /// for the one-byte types but `i8` (itself), the signed integer of the
    /// size for the others (`bf16` -> `i16`, `u32` -> `i32`, `c64` ->
    /// `i64`). `None`
    /// for `c128`: no 16-byte integer type exists; read it as bytes.
    pub fn raw(self) -> Option<Dtype> {
        match self.size() {
            1 => Some(if self == Dtype::I8 {
                Dtype::I8
            } else {
                Dtype::U8
            }),
            2 => Some(Dtype::I16),
            4 => Some(Dtype::I32),
            8 => Some(Dtype::I64),
            _ => None,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Dtype::ALL.iter().map(|d| d.name()).collect();
                Error::arg("dtype", format!("{s:?} is not one of {}", names.join(", ")))
            })
    }
}

/// How the allocation is named, per mechanism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Source {
    /// A legacy IPC handle.
    Legacy {
        /// The allocation's handle.
        handle: IpcMemHandle,
    },
    /// A VMM allocation's file descriptor.
    Vmm {
        /// The descriptor's number in the exporting process (for
        /// `pidfd_getfd`); over the channel the descriptor travels itself.
        fd: i32,
    },
    /// A pool allocation.
    Pool {
        /// The pool's file descriptor's number in the exporting process.
        fd: i32,
        /// The pointer's export data.
        ptr: PoolPtrHandle,
    },
    /// A fabric handle.
    Fabric {
        /// The allocation's fabric handle.
        handle: FabricHandle,
    },
}

impl Source {
    /// The mechanism.
    pub(crate) fn mechanism(&self) -> Mechanism {
        match self {
            Source::Legacy { .. } => Mechanism::Legacy,
            Source::Vmm { .. } => Mechanism::Vmm,
            Source::Pool { .. } => Mechanism::Pool,
            Source::Fabric { .. } => Mechanism::Fabric,
        }
    }
}

/// One export, as another process (in any language) needs it.
///
/// Made by the exporting types (`SharedBuffer::descriptor`, ...) or decoded
/// with [`Descriptor::from_json`]; to build one by hand, start from
/// [`Descriptor::new`] and the `with_*` methods (more fields may come).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Descriptor {
    /// How the allocation is shared.
    pub source: Source,
    /// Size of the whole allocation, in bytes.
    pub alloc_size: u64,
    /// Where the exported bytes start in the allocation.
    pub offset: u64,
    /// How many bytes are exported (`len` in the JSON).
    pub byte_len: u64,
    /// What the bytes hold.
    pub dtype: Dtype,
    /// Dimensions in elements, if the exporter gave them.
    pub shape: Option<Vec<u64>>,
    /// Strides in elements, one per dimension (only with `shape`); absent
    /// means contiguous row-major.
    pub strides: Option<Vec<u64>>,
    /// The device, by UUID (ordinals differ between processes).
    pub device_uuid: DeviceUuid,
    /// The exporting process.
    pub pid: u32,
    /// An interprocess event recorded after the exporter's writes, if any.
    pub event: Option<IpcEventHandle>,
    /// A number that changes whenever the exporter reuses an address for a
    /// new allocation, for caches of mappings.
    pub generation: Option<u64>,
}

const FIELDS: &[&str] = &[
    VERSION_KEY,
    "mechanism",
    "handle",
    "fd",
    "alloc_size",
    "offset",
    "len",
    "dtype",
    "elem_size",
    "shape",
    "strides",
    "device_uuid",
    "pid",
    "event",
    "generation",
];

fn field_err(field: &str, reason: impl Into<String>) -> Error {
    Error::Descriptor {
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// `field_err` in the shape the shared field decoder wants.
fn descriptor_err(field: &str, reason: String) -> Error {
    field_err(field, reason)
}

fn fd_field(f: &Fields<'_>) -> Result<i32> {
    let n = f.req::<u64>("fd")?;
    i32::try_from(n).map_err(|_| field_err("fd", format!("{n} is not a file descriptor number")))
}

fn forbid(f: &Fields<'_>, key: &str, mechanism: Mechanism) -> Result<()> {
    match f.opt::<&Value>(key)? {
        Some(_) => Err(field_err(
            key,
            format!("does not belong to a {mechanism} descriptor"),
        )),
        None => Ok(()),
    }
}

impl Descriptor {
    /// A descriptor of the whole allocation of `alloc_size` bytes as bytes
    /// (`u8`), with no shape, event or generation: set those with the
    /// `with_*` methods. Not validated until [`Descriptor::validate`] or
    /// an open.
    pub fn new(source: Source, alloc_size: u64, device_uuid: DeviceUuid, pid: u32) -> Self {
        Descriptor {
            source,
            alloc_size,
            offset: 0,
            byte_len: alloc_size,
            dtype: Dtype::U8,
            shape: None,
            strides: None,
            device_uuid,
            pid,
            event: None,
            generation: None,
        }
    }

    /// Exports `byte_len` bytes from `offset` in the allocation.
    #[must_use]
    pub fn with_range(mut self, offset: u64, byte_len: u64) -> Self {
        self.offset = offset;
        self.byte_len = byte_len;
        self
    }

    /// The element type.
    #[must_use]
    pub fn with_dtype(mut self, dtype: Dtype) -> Self {
        self.dtype = dtype;
        self
    }

    /// Dimensions in elements.
    #[must_use]
    pub fn with_shape(mut self, shape: Vec<u64>) -> Self {
        self.shape = Some(shape);
        self
    }

    /// The interprocess event recorded after the exporter's writes.
    #[must_use]
    pub fn with_event(mut self, event: IpcEventHandle) -> Self {
        self.event = Some(event);
        self
    }

    /// The allocation's generation, for caches of mappings.
    #[must_use]
    pub fn with_generation(mut self, generation: u64) -> Self {
        self.generation = Some(generation);
        self
    }

    /// Parses and validates a descriptor from JSON text.
    pub fn from_json(text: &str) -> Result<Self> {
        let value: Value = crate::json::parse_strict(text)
            .map_err(|e| field_err("(document)", format!("not valid JSON: {e}")))?;
        Self::from_value(&value)
    }

    /// Validates a descriptor already parsed as JSON.
    pub fn from_value(value: &Value) -> Result<Self> {
        let map = value.as_object().ok_or_else(|| {
            field_err(
                "(document)",
                format!("expected a JSON object, found {}", kind_of(value)),
            )
        })?;
        let f = Fields::new(map, descriptor_err);
        if let Some(unknown) = f.unknown(FIELDS) {
            return Err(field_err(
                unknown,
                format!("unknown field (this reader knows format {FORMAT_VERSION})"),
            ));
        }
        let version = f.req::<u64>(VERSION_KEY)?;
        if version != FORMAT_VERSION {
            return Err(field_err(
                VERSION_KEY,
                format!(
                    "format {version} is not supported; this build reads format {FORMAT_VERSION}"
                ),
            ));
        }
        let mechanism: Mechanism = f.req("mechanism")?;
        let source = match mechanism {
            Mechanism::Legacy => {
                forbid(&f, "fd", mechanism)?;
                Source::Legacy {
                    handle: f.req("handle")?,
                }
            }
            Mechanism::Fabric => {
                forbid(&f, "fd", mechanism)?;
                Source::Fabric {
                    handle: f.req("handle")?,
                }
            }
            Mechanism::Vmm => {
                forbid(&f, "handle", mechanism)?;
                Source::Vmm { fd: fd_field(&f)? }
            }
            Mechanism::Pool => Source::Pool {
                fd: fd_field(&f)?,
                ptr: f.req("handle")?,
            },
        };
        let dtype: Dtype = f.req("dtype")?;
        if let Some(n) = f.opt::<u64>("elem_size")?
            && n != dtype.size()
        {
            return Err(field_err(
                "elem_size",
                format!("{n} does not match dtype {dtype} ({} bytes)", dtype.size()),
            ));
        }
        let pid = f.req::<u64>("pid")?;
        let pid = u32::try_from(pid)
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| field_err("pid", format!("{pid} is not a process id")))?;
        let event = f.opt("event")?;
        let generation = f.opt::<u64>("generation")?;
        let d = Descriptor {
            source,
            alloc_size: f.req::<u64>("alloc_size")?,
            offset: f.req::<u64>("offset")?,
            byte_len: f.req::<u64>("len")?,
            dtype,
            shape: f.opt::<Vec<u64>>("shape")?,
            strides: f.opt::<Vec<u64>>("strides")?,
            device_uuid: f.req("device_uuid")?,
            pid,
            event,
            generation,
        };
        d.validate()?;
        Ok(d)
    }

    /// Checks that sizes, offsets, shape and strides agree; the decoder
    /// calls it, and so should code that builds a descriptor by hand.
    pub fn validate(&self) -> Result<()> {
        let elem = self.dtype.size();
        if self.alloc_size == 0 {
            return Err(field_err("alloc_size", "must be greater than zero"));
        }
        if self.byte_len == 0 {
            return Err(field_err("len", "must be greater than zero"));
        }
        if !self.byte_len.is_multiple_of(elem) {
            return Err(field_err(
                "len",
                format!(
                    "{} is not a whole number of {elem}-byte {} elements",
                    self.byte_len, self.dtype
                ),
            ));
        }
        if !self.offset.is_multiple_of(elem) {
            return Err(field_err(
                "offset",
                format!(
                    "{} is not aligned to the {elem}-byte {} elements",
                    self.offset, self.dtype
                ),
            ));
        }
        if !crate::error::in_bounds(self.offset, self.byte_len, self.alloc_size) {
            return Err(field_err(
                "len",
                format!(
                    "offset {} + len {} passes the end of the {}-byte allocation",
                    self.offset, self.byte_len, self.alloc_size
                ),
            ));
        }
        if let Source::Vmm { fd } | Source::Pool { fd, .. } = self.source
            && fd < 0
        {
            {
                return Err(field_err(
                    "fd",
                    format!("{fd} is not a file descriptor number"),
                ));
            }
        }
        match (&self.shape, &self.strides) {
            (None, Some(_)) => return Err(field_err("strides", "given without shape")),
            (Some(shape), strides) => self.validate_shape(shape, strides.as_deref())?,
            (None, None) => {}
        }
        Ok(())
    }

    fn validate_shape(&self, shape: &[u64], strides: Option<&[u64]>) -> Result<()> {
        let elem = self.dtype.size();
        let count = self.byte_len / elem;
        match strides {
            None => {
                let product = shape
                    .iter()
                    .try_fold(1u64, |acc, d| acc.checked_mul(*d))
                    .ok_or_else(|| field_err("shape", "the product of the dimensions overflows"))?;
                if product != count {
                    return Err(field_err(
                        "shape",
                        format!("{shape:?} holds {product} elements but len holds {count}"),
                    ));
                }
            }
            Some(strides) => {
                if strides.len() != shape.len() {
                    return Err(field_err(
                        "strides",
                        format!("{} strides for {} dimensions", strides.len(), shape.len()),
                    ));
                }
                // The last element reached must lie inside the exported bytes.
                if !shape.contains(&0) {
                    let last = shape
                        .iter()
                        .zip(strides)
                        .try_fold(0u64, |acc, (d, s)| {
                            (d - 1).checked_mul(*s).and_then(|x| acc.checked_add(x))
                        })
                        .ok_or_else(|| field_err("strides", "the extent overflows"))?;
                    if last >= count {
                        return Err(field_err(
                            "strides",
                            format!(
                                "shape {shape:?} with strides {strides:?} reaches element {last}, past the {count} exported"
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The mechanism.
    pub fn mechanism(&self) -> Mechanism {
        self.source.mechanism()
    }

    /// Number of elements in the exported bytes.
    pub fn elements(&self) -> u64 {
        self.byte_len / self.dtype.size()
    }

    /// The descriptor as a JSON value (keys sorted).
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        m.insert(VERSION_KEY.into(), FORMAT_VERSION.into());
        m.insert("mechanism".into(), self.mechanism().name().into());
        match self.source {
            Source::Legacy { handle } => {
                m.insert("handle".into(), handle.to_string().into());
            }
            Source::Fabric { handle } => {
                m.insert("handle".into(), handle.to_string().into());
            }
            Source::Vmm { fd } => {
                m.insert("fd".into(), fd.into());
            }
            Source::Pool { fd, ptr } => {
                m.insert("fd".into(), fd.into());
                m.insert("handle".into(), ptr.to_string().into());
            }
        }
        m.insert("alloc_size".into(), self.alloc_size.into());
        m.insert("offset".into(), self.offset.into());
        m.insert("len".into(), self.byte_len.into());
        m.insert("dtype".into(), self.dtype.name().into());
        m.insert("elem_size".into(), self.dtype.size().into());
        if let Some(shape) = &self.shape {
            m.insert("shape".into(), shape.clone().into());
        }
        if let Some(strides) = &self.strides {
            m.insert("strides".into(), strides.clone().into());
        }
        m.insert("device_uuid".into(), self.device_uuid.to_string().into());
        m.insert("pid".into(), self.pid.into());
        if let Some(e) = self.event {
            m.insert("event".into(), e.to_string().into());
        }
        if let Some(g) = self.generation {
            m.insert("generation".into(), g.into());
        }
        Value::Object(m)
    }

    /// The descriptor as one line of JSON.
    pub fn to_json(&self) -> String {
        self.to_value().to_string()
    }
}

crate::json::json_record!(Descriptor);
