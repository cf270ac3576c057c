//! The producer of the simpleIPC-style sample pair (see `consumer.rs`).
//!
//! It fills a buffer on the GPU, records an interprocess event, exports
//! both, and starts the consumer with the descriptor on its standard input.
//! The consumer maps the buffer, waits on the event, transforms every value
//! with a kernel and answers with its own event; the producer waits on that
//! event and checks every element.
//!
//! ```text
//! cargo run --release --example producer -- --consumer target/release/examples/consumer
//! ```

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Device, DeviceMemory, Dtype, IpcEvent, IpcEventHandle};

const PATTERN: Pattern = Pattern::ramp(1000, 1);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut consumer = None;
    let mut size: u64 = 64 << 20;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--consumer" => consumer = args.next(),
            "--size" => {
                size = args
                    .next()
                    .ok_or("--size needs a value")?
                    .parse::<cuda_ipc::units::ByteSize>()?
                    .0;
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: producer --consumer PATH [--size SIZE]"
                )
                .into());
            }
        }
    }
    let consumer = consumer.ok_or("usage: producer --consumer PATH_TO_CONSUMER [--size SIZE]")?;

    let device = Device::open(0)?;
    // The best mechanism this device supports (VMM file descriptors on an H200).
    let buffer = SharedBuffer::alloc(&device, size as usize, None)?;
    kernels::fill_u32(&buffer, PATTERN, Speed::Full)?;
    let ready = IpcEvent::new(&device)?;
    ready.record(buffer.stream())?;
    if buffer.mechanism().uses_fd() {
        // The consumer takes the file descriptor from us with pidfd_getfd.
        share::allow_fd_fetching()?;
    }
    let mut export = buffer.export_region(0, size, Dtype::U32, None)?;
    export.descriptor.event = Some(ready.handle()?);
    println!(
        "producer: exported {size} bytes with the {} mechanism",
        buffer.mechanism()
    );

    let mut child = Command::new(consumer)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut to_child = child.stdin.take().ok_or("no stdin")?;
    writeln!(to_child, "{}", export.descriptor)?;
    to_child.flush()?;
    let mut reply = String::new();
    BufReader::new(child.stdout.take().ok_or("no stdout")?).read_line(&mut reply)?;
    let handle: IpcEventHandle = reply.trim().parse()?;

    // Order our check after the consumer's kernel, on the device.
    let done = IpcEvent::open(&device, handle)?;
    done.wait_on(buffer.stream())?;
    let bad = kernels::check_u32(&buffer, PATTERN.mapped(2, 1))?;
    drop(done);
    drop(to_child); // tells the consumer we are done with its event
    let status = child.wait()?;
    match bad {
        None if status.success() => {
            println!(
                "producer: all {} values were transformed by the consumer",
                size / 4
            );
            Ok(())
        }
        None => Err(format!("the consumer failed: {status}").into()),
        Some(i) => Err(format!("value {i} was not transformed").into()),
    }
}
