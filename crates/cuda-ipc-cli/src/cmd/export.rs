//! `cuda-ipc export`: allocate, fill, print a descriptor, keep the memory
//! alive until standard input ends.

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share;
use cuda_ipc::{Device, DeviceMemory, Dtype, Error};

use crate::Outcome;
use crate::out::outln;

/// Arguments of `export`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Size of the exported region (4096, 2MiB, 1GiB, ...).
    #[arg(long, value_parser = super::parse_size, allow_negative_numbers = true)]
    pub size: u64,
    /// Fill every 32-bit word of the region with this value (decimal or 0x hex).
    #[arg(long, value_parser = super::parse_value, allow_negative_numbers = true)]
    pub fill_u32: u32,
    /// Export a region starting this many bytes into a larger allocation
    /// (the bytes before it hold the bitwise complement of the value).
    #[arg(long, value_parser = super::parse_size, default_value = "0", allow_negative_numbers = true)]
    pub offset: u64,
    /// How to share: auto, legacy, vmm, pool or fabric.
    #[arg(long, value_parser = super::parse_mechanism, default_value = "auto")]
    pub mechanism: super::MechanismArg,
    /// Device ordinal.
    #[arg(long, default_value_t = 0, value_parser = super::parse_device, allow_negative_numbers = true)]
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
    let buffer = super::alloc_filled(&device, total, args.mechanism, !args.fill_u32)?;
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
    outln!("{}", export.descriptor)?;
    // Keep the memory (and the exported descriptors) alive until stdin ends.
    super::wait_for_stdin_end()?;
    drop(export);
    drop(buffer);
    Ok(Outcome::Ok)
}
