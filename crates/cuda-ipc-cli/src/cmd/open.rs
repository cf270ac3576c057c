//! `cuda-ipc open`: map memory another process exported (ours, PyTorch's,
//! CuPy's), check it, optionally fill it, unmap.

use std::fmt::Write as _;
use std::io::BufRead;
use std::time::Instant;

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{
    Descriptor, Device, DeviceMemory, Error, IpcMemHandle, LegacyMapping, MappedBuffer, OpenFlags,
    share,
};

use crate::Outcome;
use crate::out::{errln, outln};

/// Arguments of `open`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["descriptor", "handle"])))]
pub struct Args {
    /// The exporter's descriptor (JSON), or `-` to read one line from standard input.
    #[arg(long)]
    pub descriptor: Option<String>,
    /// A legacy IPC memory handle (128 hex digits), with --size and --offset.
    #[arg(long, requires = "size")]
    pub handle: Option<IpcMemHandle>,
    /// Size of the region to map (with --handle); with --descriptor, how
    /// much of the described region to use (default: the rest of it).
    #[arg(long, value_parser = super::parse_size, allow_negative_numbers = true)]
    pub size: Option<u64>,
    /// Where the region starts inside the allocation (with --handle), or
    /// inside the described region (with --descriptor).
    #[arg(long, value_parser = super::parse_size, default_value = "0", allow_negative_numbers = true)]
    pub offset: u64,
    /// Check that every 32-bit word equals this value (exit 1 on the first mismatch).
    #[arg(long, value_parser = super::parse_value, allow_negative_numbers = true)]
    pub expect_u32: Option<u32>,
    /// Then fill every 32-bit word with this value.
    #[arg(long, value_parser = super::parse_value, allow_negative_numbers = true)]
    pub fill_u32: Option<u32>,
    /// Device ordinal (default: the descriptor's GPU, found by its UUID
    /// whatever CUDA_VISIBLE_DEVICES says; device 0 for a bare handle).
    #[arg(long, value_parser = super::parse_device, allow_negative_numbers = true)]
    pub device: Option<usize>,
}

/// The most `--descriptor -` reads from standard input: a descriptor is a
/// few hundred bytes, so anything this long is not one.
pub const MAX_DESCRIPTOR_LINE: usize = 1 << 20;

/// What to map, checked before the driver is loaded.
enum Source {
    /// A descriptor, and the part of its region to use (`start..end`, bytes).
    Descriptor(Descriptor, u64, u64),
    /// A legacy handle with the region's offset and size inside the allocation.
    Handle(IpcMemHandle, u64, u64),
}

/// Checks `--size` and `--offset` as `export` does: the region holds 32-bit
/// words, so a size given must be a positive multiple of 4 and the offset a
/// multiple of 4.
fn check_region(size: Option<u64>, offset: u64) -> Result<(), Error> {
    let size_ok = size.is_none_or(|s| s > 0 && s.is_multiple_of(4));
    if size_ok && offset.is_multiple_of(4) {
        return Ok(());
    }
    let size = size.map_or_else(|| "the rest of the region".into(), |s| s.to_string());
    Err(Error::InvalidArgument {
        what: "size or offset",
        reason: format!(
            "the region holds 32-bit words, so --size ({size}) must be a positive multiple of 4 \
             and --offset ({offset}) a multiple of 4"
        ),
    })
}

fn source(args: &Args) -> Result<Source, Error> {
    check_region(args.size, args.offset)?;
    if let Some(handle) = args.handle {
        let size = args.size.unwrap_or_default();
        return Ok(Source::Handle(handle, args.offset, size));
    }
    let descriptor = match args.descriptor.as_deref() {
        Some("-") => read_descriptor(&mut std::io::stdin().lock())?,
        Some(text) => Descriptor::from_json(text)?,
        None => {
            return Err(Error::InvalidArgument {
                what: "arguments",
                reason: "give --descriptor or --handle".into(),
            });
        }
    };
    let len = descriptor.byte_len;
    let size = args.size.unwrap_or(len.saturating_sub(args.offset));
    let end = args.offset.checked_add(size).filter(|&end| end <= len);
    let Some(end) = end else {
        return Err(Error::InvalidArgument {
            what: "offset or size",
            reason: format!(
                "--offset {} with --size {size} passes the end of the described region ({len} bytes)",
                args.offset
            ),
        });
    };
    if args.expect_u32.is_some() || args.fill_u32.is_some() {
        super::check_words(size, "region")?;
    }
    Ok(Source::Descriptor(descriptor, args.offset, end))
}

/// Reads one descriptor line from `input`, at most [`MAX_DESCRIPTOR_LINE`]
/// bytes of it.
pub fn read_descriptor(input: &mut impl BufRead) -> Result<Descriptor, Error> {
    let bad = |reason: String| Error::InvalidArgument {
        what: "descriptor on standard input",
        reason,
    };
    let one_line = "expected the descriptor as one line of JSON, as `cuda-ipc export` prints it \
                    (`jq -c .` puts a pretty-printed one on one line)";
    let line = match cuda_ipc_bench::lines::read_line(input, MAX_DESCRIPTOR_LINE) {
        Ok(Some(line)) => line,
        Ok(None) => return Err(bad(format!("standard input is empty; {one_line}"))),
        Err(cuda_ipc_bench::lines::LineError::TooLong) => {
            return Err(bad(format!(
                "the first line is longer than {}; {one_line}",
                super::human(MAX_DESCRIPTOR_LINE as u64)
            )));
        }
        Err(cuda_ipc_bench::lines::LineError::NotUtf8) => {
            return Err(bad(format!("the input is not UTF-8 text; {one_line}")));
        }
        Err(cuda_ipc_bench::lines::LineError::Io(e)) => {
            return Err(Error::Io {
                context: "reading the descriptor from standard input".into(),
                source: e,
            });
        }
    };
    let text = line.trim();
    if text.is_empty() {
        return Err(bad(format!("the first line is empty; {one_line}")));
    }
    if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(text)
        && e.is_eof()
    {
        return Err(bad(format!(
            "the first line is not a whole JSON document (it ends at column {}); {one_line}",
            e.column()
        )));
    }
    Descriptor::from_json(text)
}

pub fn run(args: &Args) -> Result<Outcome, Error> {
    let source = source(args)?;
    let device = match (args.device, &source) {
        (Some(ordinal), _) => Device::open(ordinal)?,
        (None, Source::Descriptor(d, ..)) => share::device_for(d)?,
        (None, Source::Handle(..)) => Device::open(0)?,
    };
    let started = Instant::now();
    let (buffer, mechanism): (MappedBuffer<u8>, String) = match &source {
        Source::Descriptor(d, start, end) => (
            share::open::<u8>(&device, d, Vec::new())?.slice(*start as usize..*end as usize)?,
            d.mechanism().to_string(),
        ),
        Source::Handle(handle, offset, size) => {
            let mapping = LegacyMapping::open(&device, *handle, OpenFlags::default())?;
            (
                MappedBuffer::from_bytes(mapping, *offset, *size)?,
                "legacy".into(),
            )
        }
    };
    let open_ms = super::ms_since(started);
    let len = buffer.byte_len() as u64;
    let mut report = format!(
        "opened {} ({mechanism}) in {open_ms:.3} ms",
        super::human(len)
    );
    if let Some(want) = args.expect_u32 {
        if let Some(i) = kernels::check_u32(&buffer, Pattern::constant(want))? {
            let found: Vec<u32> = buffer.slice(i as usize * 4..i as usize * 4 + 4)?.to_vec()?;
            errln!(
                "cuda-ipc: mismatch: word {i} (byte {}) is {:#010x}, expected {want:#010x}",
                i * 4,
                found[0]
            );
            return Ok(Outcome::Mismatch);
        }
        let _ = write!(report, "; all {} words equal {want:#010x}", len / 4);
    }
    if let Some(value) = args.fill_u32 {
        kernels::fill_u32(&buffer, Pattern::constant(value), Speed::Full)?;
        buffer.synchronize()?;
        let _ = write!(report, "; filled with {value:#010x}");
    }
    drop(buffer);
    outln!("{report}")?;
    Ok(Outcome::Ok)
}
