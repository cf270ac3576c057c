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
    /// Size of the region to map, with --handle.
    #[arg(long, value_parser = super::parse_size, requires = "handle")]
    pub size: Option<u64>,
    /// Where the region starts inside the allocation, with --handle.
    #[arg(long, value_parser = super::parse_size, requires = "handle", default_value = "0")]
    pub offset: u64,
    /// Check that every 32-bit word equals this value (exit 1 on the first mismatch).
    #[arg(long, value_parser = super::parse_value)]
    pub expect_u32: Option<u32>,
    /// Then fill every 32-bit word with this value.
    #[arg(long, value_parser = super::parse_value)]
    pub fill_u32: Option<u32>,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}

pub fn run(args: &Args) -> Result<Outcome, Error> {
    let descriptor = match args.descriptor.as_deref() {
        Some("-") => {
            let mut line = String::new();
            std::io::stdin()
                .lock()
                .read_line(&mut line)
                .map_err(|e| Error::Io {
                    context: "reading the descriptor from standard input".into(),
                    source: e,
                })?;
            Some(Descriptor::from_json(line.trim())?)
        }
        Some(text) => Some(Descriptor::from_json(text)?),
        None => None,
    };
    let device = Device::open(args.device)?;
    let started = Instant::now();
    let (buffer, mechanism): (MappedBuffer<u8>, String) = match (&descriptor, args.handle) {
        (Some(d), _) => (
            share::open(&device, d, Vec::new())?,
            d.mechanism().to_string(),
        ),
        (None, Some(handle)) => {
            let size = args.size.unwrap_or_default();
            let mapping = LegacyMapping::open(&device, handle, OpenFlags::default())?;
            (
                MappedBuffer::from_bytes(mapping, args.offset, size)?,
                "legacy".into(),
            )
        }
        (None, None) => unreachable!("clap requires --descriptor or --handle"),
    };
    let open_ms = super::ms_since(started);
    let len = buffer.byte_len() as u64;
    let mut report = format!(
        "opened {} ({mechanism}) in {open_ms:.3} ms",
        super::human(len)
    );
    if (args.expect_u32.is_some() || args.fill_u32.is_some()) && !len.is_multiple_of(4) {
        return Err(Error::InvalidArgument {
            what: "region",
            reason: format!("{len} bytes is not a whole number of 32-bit words"),
        });
    }
    if let Some(want) = args.expect_u32 {
        if let Some(i) = kernels::check_u32(&buffer, Pattern::constant(want))? {
            let found: Vec<u32> = buffer.slice(i as usize * 4..i as usize * 4 + 4)?.to_vec()?;
            eprintln!(
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
    println!("{report}");
    Ok(Outcome::Ok)
}
