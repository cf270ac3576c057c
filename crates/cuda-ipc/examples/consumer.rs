//! The consumer of the simpleIPC-style sample pair (started by `producer.rs`).
//!
//! It reads a descriptor from standard input, maps the memory (waiting on
//! the producer's event), checks it, doubles every value and adds one with a
//! kernel, records its own event and prints the event's handle. It keeps the
//! mapping and the event until its standard input ends.
//!
//! Errors are one sentence on standard error, with the `cuda-ipc` command's
//! exit codes (1 mismatch, 2 bad input, 3 no driver or device, 4 other).

use std::io::{BufRead, Read};
use std::process::ExitCode;

use cuda_ipc::kernels::{self, Pattern};
use cuda_ipc::{Descriptor, Device, DeviceMemory, Error, ErrorKind, IpcEvent, share};

const PATTERN: Pattern = Pattern::ramp(1000, 1);

/// A descriptor is a few hundred bytes; read no more than this of a line.
const MAX_LINE: u64 = 1 << 20;

fn main() -> ExitCode {
    match run() {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(i)) => {
            eprintln!("consumer: error: value {i} is not what the producer wrote");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("consumer: error: {e}");
            ExitCode::from(match e.kind() {
                ErrorKind::InvalidInput => 2,
                ErrorKind::Unavailable => 3,
                _ => 4,
            })
        }
    }
}

/// Runs the consumer; `Some(i)` if value `i` was not the producer's.
fn run() -> Result<Option<u64>, Error> {
    let read_error = |source| Error::Io {
        context: "reading the descriptor from standard input".into(),
        source,
    };
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .take(MAX_LINE)
        .read_line(&mut line)
        .map_err(read_error)?;
    let descriptor = Descriptor::from_json(line.trim())?;
    let device = Device::open(0)?;
    // Maps the memory and makes our stream wait on the producer's event.
    let buffer = share::open::<u32>(&device, &descriptor, Vec::new())?;
    if let Some(i) = kernels::check_u32(&buffer, PATTERN)? {
        return Ok(Some(i));
    }
    eprintln!("consumer: {} values received intact", buffer.len());
    kernels::map_u32(&buffer, 2, 1)?;
    let done = IpcEvent::new(&device)?;
    done.record(buffer.stream())?;
    println!("{}", done.handle()?);
    // Keep the event and the mapping until the producer has waited on it.
    std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink()).map_err(read_error)?;
    drop(done);
    drop(buffer);
    Ok(None)
}
