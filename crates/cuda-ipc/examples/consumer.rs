//! The consumer of the simpleIPC-style sample pair (started by `producer.rs`).
//!
//! It reads a descriptor from standard input, maps the memory (waiting on
//! the producer's event), checks it, doubles every value and adds one with a
//! kernel, records its own event and prints the event's handle. It keeps the
//! mapping and the event until its standard input ends.

use std::io::{BufRead, Read};

use cuda_ipc::kernels::{self, Pattern};
use cuda_ipc::{Descriptor, Device, DeviceMemory, IpcEvent, share};

const PATTERN: Pattern = Pattern::ramp(1000, 1);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let descriptor = Descriptor::from_json(line.trim())?;
    let device = Device::open(0)?;
    // Maps the memory and makes our stream wait on the producer's event.
    let buffer = share::open::<u32>(&device, &descriptor, Vec::new())?;
    if let Some(i) = kernels::check_u32(&buffer, PATTERN)? {
        return Err(format!("value {i} is not what the producer wrote").into());
    }
    eprintln!("consumer: {} values received intact", buffer.len());
    kernels::map_u32(&buffer, 2, 1)?;
    let done = IpcEvent::new(&device)?;
    done.record(buffer.stream())?;
    println!("{}", done.handle()?);
    // Keep the event and the mapping until the producer has waited on it.
    std::io::stdin().lock().read_to_end(&mut Vec::new())?;
    drop(done);
    drop(buffer);
    Ok(())
}
