//! A Rust producer for a PyTorch (or CuPy) consumer using `cuda_ipc.open`.
//!
//! It allocates a buffer with the best mechanism the device supports (or
//! `--mechanism`), fills it with `1000, 1001, 1002, ...` as `int32`,
//! records an interprocess event, and prints the descriptor (with shape
//! `[rows, 1024]` and the event) on standard output. It then reads the
//! consumer's event handle from standard input, waits on it on the device,
//! checks that every element became `2x + 1`, prints the result, and keeps
//! the memory alive until its standard input ends.
//!
//! The Python side:
//!
//! ```python
//! import subprocess, torch, cuda_ipc
//!
//! p = subprocess.Popen(["target/release/examples/torch_producer", "--size", "64MiB"],
//!                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
//! m = cuda_ipc.open(p.stdout.readline())         # waits on the producer's event
//! t = m.as_torch()                               # torch.int32, [16384, 1024], no copy
//! assert torch.equal(t.flatten(), torch.arange(t.numel(), device=t.device, dtype=torch.int32) + 1000)
//! t.mul_(2).add_(1)
//! ev = torch.cuda.Event(interprocess=True)
//! ev.record()                                    # after our writes
//! p.stdin.write(ev.ipc_handle().hex() + "\n"); p.stdin.flush()
//! print(p.stdout.readline().strip())             # "torch_producer: all ... are 2x + 1"
//! del t; m.close()                               # unmap before the producer frees
//! p.stdin.close(); p.wait()
//! ```
//!
//! ```text
//! cargo build --release --example torch_producer
//! ```
//!
//! Errors are one line on standard error; the exit code is 1 if a value was
//! not `2x + 1`, 2 for bad input, 3 without a driver or device, 4 otherwise.

use std::io::{BufRead, Read, Write};
use std::process::ExitCode;

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::units::ByteSize;
use cuda_ipc::{
    Device, DeviceMemory, Dtype, Error, ErrorKind, IpcEvent, IpcEventHandle, Mechanism,
};

const PATTERN: Pattern = Pattern::ramp(1000, 1);
const ROW: u64 = 1024;

const USAGE: &str =
    "usage: torch_producer [--size SIZE] [--mechanism auto|legacy|vmm|pool] [--device N]";

fn usage() -> Error {
    bad_input(USAGE.into())
}

fn bad_input(reason: String) -> Error {
    Error::InvalidArgument {
        what: "arguments",
        reason,
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("torch_producer: error: {e}");
            ExitCode::from(match e.downcast_ref::<Error>().map(Error::kind) {
                Some(ErrorKind::InvalidInput) => 2,
                Some(ErrorKind::Unavailable) => 3,
                _ => 4,
            })
        }
    }
}

/// Runs the producer; `false` if a value was not `2x + 1`.
fn run() -> Result<bool, Box<dyn std::error::Error>> {
    let mut size: u64 = 64 << 20;
    let mut mechanism: Option<Mechanism> = None;
    let mut ordinal = 0usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(usage);
        match a.as_str() {
            "--size" => size = value()?.parse::<ByteSize>()?.0,
            "--mechanism" => {
                mechanism = match value()?.as_str() {
                    "auto" => None,
                    m => Some(m.parse()?),
                }
            }
            "--device" => {
                let v = value()?;
                ordinal = v
                    .parse()
                    .map_err(|_| bad_input(format!("--device {v:?} is not a device ordinal")))?;
            }
            _ => return Err(bad_input(format!("unknown argument {a:?}; {USAGE}")).into()),
        }
    }
    let row_bytes = ROW * 4;
    if size == 0 || !size.is_multiple_of(row_bytes) {
        return Err(bad_input(format!(
            "--size must be a positive multiple of {row_bytes} bytes (rows of {ROW} int32)"
        ))
        .into());
    }

    let device = Device::open(ordinal)?;
    let buffer = SharedBuffer::alloc(&device, size as usize, mechanism)?;
    kernels::fill_u32(&buffer, PATTERN, Speed::Full)?;
    let ready = IpcEvent::new(&device)?;
    ready.record(buffer.stream())?;
    if buffer.mechanism().uses_fd() {
        // Python takes the file descriptor from us with pidfd_getfd.
        share::allow_fd_fetching()?;
    }
    let mut export =
        buffer.export_region(0, size, Dtype::I32, Some(vec![size / row_bytes, ROW]))?;
    export.descriptor.event = Some(ready.handle()?);
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", export.descriptor)?;
    out.flush()?;
    eprintln!(
        "torch_producer: exported {size} bytes with the {} mechanism",
        buffer.mechanism()
    );

    // The consumer's event, recorded after its writes.
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    if line.trim().is_empty() {
        return Err("the consumer closed our standard input without sending its event".into());
    }
    let handle: IpcEventHandle = line.trim().parse()?;
    let done = IpcEvent::open(&device, handle)?;
    done.wait_on(buffer.stream())?;
    let words = size / 4;
    let bad = kernels::check_u32(&buffer, PATTERN.mapped(2, 1))?;
    match bad {
        None => writeln!(out, "torch_producer: all {words} values are 2x + 1")?,
        Some(i) => writeln!(out, "torch_producer: value {i} is not 2x + 1")?,
    }
    out.flush()?;
    // Keep the memory until the consumer has unmapped it.
    std::io::stdin().lock().read_to_end(&mut Vec::new())?;
    drop(export);
    drop(buffer);
    Ok(bad.is_none())
}
