//! `cuda-ipc export`: allocate, fill, print a descriptor, keep the memory
//! alive until standard input ends.

use std::io::{Read, Write};

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Device, DeviceMemory, Dtype, Error};

use crate::Outcome;

/// Arguments of `export`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Size of the exported region (4096, 2MiB, 1GiB, ...).
    #[arg(long, value_parser = super::parse_size)]
    pub size: u64,
    /// Fill every 32-bit word of the region with this value (decimal or 0x hex).
    #[arg(long, value_parser = super::parse_value)]
    pub fill_u32: u32,
    /// Export a region starting this many bytes into a larger allocation
    /// (the bytes before it are filled with the bitwise complement of the value).
    #[arg(long, value_parser = super::parse_size, default_value = "0")]
    pub offset: u64,
    /// How to share: auto, legacy, vmm, pool or fabric.
    #[arg(long, value_parser = super::parse_mechanism, default_value = "auto")]
    pub mechanism: super::MechanismArg,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}

pub fn run(args: &Args) -> Result<Outcome, Error> {
    if args.size == 0 || !args.size.is_multiple_of(4) || !args.offset.is_multiple_of(4) {
        return Err(Error::InvalidArgument {
            what: "size or offset",
            reason: format!(
                "the region holds 32-bit words, so --size ({}) must be a positive multiple of 4 and --offset ({}) a multiple of 4",
                args.size, args.offset
            ),
        });
    }
    let total = args
        .offset
        .checked_add(args.size)
        .ok_or_else(|| Error::InvalidArgument {
            what: "size",
            reason: "offset + size overflows".into(),
        })?;
    let device = Device::open(args.device)?;
    let buffer = SharedBuffer::alloc(&device, total as usize, args.mechanism.0)?;
    if args.offset > 0 {
        let head = buffer.region(0, args.offset)?;
        kernels::fill_u32(&head, Pattern::constant(!args.fill_u32), Speed::Full)?;
    }
    let region = buffer.region(args.offset, args.size)?;
    kernels::fill_u32(&region, Pattern::constant(args.fill_u32), Speed::Full)?;
    device.synchronize()?;
    if buffer.mechanism().uses_fd() {
        // Scripts open fd exports with pidfd_getfd, which needs this under Yama.
        share::allow_fd_fetching()?;
    }
    let export = buffer.export_region(
        args.offset,
        args.size,
        Dtype::U32,
        Some(vec![args.size / 4]),
    )?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", export.descriptor)
        .and_then(|()| out.flush())
        .map_err(|e| Error::Io {
            context: "printing the descriptor".into(),
            source: e,
        })?;
    drop(out);
    // Keep the memory (and the exported descriptors) alive until stdin ends.
    let mut sink = [0u8; 4096];
    let mut stdin = std::io::stdin().lock();
    loop {
        match stdin.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(Error::Io {
                    context: "reading standard input".into(),
                    source: e,
                });
            }
        }
    }
    drop(export);
    drop(buffer);
    Ok(Outcome::Ok)
}
