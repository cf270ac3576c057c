//! The producer of the simpleIPC-style sample pair (see `consumer.rs`).
//!
//! It fills a buffer on the GPU, records an interprocess event, exports
//! both, and starts the consumer with the descriptor on its standard input.
//! The consumer maps the buffer, waits on the event, transforms every value
//! with a kernel and answers with its own event; the producer waits on that
//! event and checks every element.
//!
//! ```text
//! cargo build --release --example producer --example consumer
//! target/release/examples/producer --consumer target/release/examples/consumer
//! ```
//!
//! Errors are one sentence on standard error, and the exit codes are the
//! `cuda-ipc` command's: 1 the data did not match, 2 bad input or usage,
//! 3 no driver, no device or unsupported here, 4 another failure.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Device, DeviceMemory, Dtype, Error, ErrorKind, IpcEvent, IpcEventHandle};

const PATTERN: Pattern = Pattern::ramp(1000, 1);
const USAGE: &str = "usage: producer [--consumer PATH] [--size SIZE]";

/// Why the producer failed, and its exit code.
enum Failure {
    /// The consumer's writes are not what we expected (exit 1).
    Mismatch(String),
    /// Bad arguments (exit 2).
    Usage(String),
    /// A library error (exit 2, 3 or 4 by its kind).
    Library(Error),
    /// The consumer process failed (exit 4).
    Consumer(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Library(e)
    }
}

fn main() -> ExitCode {
    let (code, message) = match run() {
        Ok(()) => return ExitCode::SUCCESS,
        Err(Failure::Mismatch(m)) => (1, m),
        Err(Failure::Usage(m)) => (2, m),
        Err(Failure::Library(e)) => {
            let code = match e.kind() {
                ErrorKind::InvalidInput => 2,
                ErrorKind::Unavailable => 3,
                _ => 4,
            };
            (code, e.to_string())
        }
        Err(Failure::Consumer(m)) => (4, m),
    };
    eprintln!("producer: error: {message}");
    ExitCode::from(code)
}

/// The consumer's path and the size, from the command line.
fn parse_args() -> Result<(PathBuf, u64), Failure> {
    let mut args = std::env::args().skip(1);
    let mut consumer = None;
    let mut size: u64 = 64 << 20;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--consumer" => {
                let path = args
                    .next()
                    .ok_or(Failure::Usage(format!("--consumer needs a path; {USAGE}")))?;
                consumer = Some(PathBuf::from(path));
            }
            "--size" => {
                let text = args
                    .next()
                    .ok_or(Failure::Usage(format!("--size needs a value; {USAGE}")))?;
                size = text.parse::<cuda_ipc::units::ByteSize>()?.0;
            }
            other => {
                return Err(Failure::Usage(format!(
                    "unknown argument {}; {USAGE}",
                    cuda_ipc::units::shorten(other, 40)
                )));
            }
        }
    }
    if size == 0 || !size.is_multiple_of(4) {
        return Err(Failure::Usage(format!(
            "--size {size} is not a positive multiple of 4 bytes"
        )));
    }
    // By default, the consumer built next to us (target/release/examples/consumer).
    let consumer = match consumer {
        Some(path) => path,
        None => std::env::current_exe()
            .map_err(|e| Failure::Consumer(format!("cannot find our own executable: {e}")))?
            .with_file_name("consumer"),
    };
    if !consumer.is_file() {
        return Err(Failure::Usage(format!(
            "no consumer at {}; build it with `cargo build --release --example consumer`, or pass --consumer PATH",
            consumer.display()
        )));
    }

    Ok((consumer, size))
}

fn run() -> Result<(), Failure> {
    let (consumer, size) = parse_args()?;
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

    let consumer_failed = |what: &str, e: std::io::Error| {
        Failure::Consumer(format!("{what} the consumer {}: {e}", consumer.display()))
    };
    let mut child = Command::new(&consumer)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| consumer_failed("cannot start", e))?;
    let mut to_child = child
        .stdin
        .take()
        .ok_or(Failure::Consumer("no pipe to the consumer".into()))?;
    let from_child = child
        .stdout
        .take()
        .ok_or(Failure::Consumer("no pipe from the consumer".into()))?;
    writeln!(to_child, "{}", export.descriptor)
        .and_then(|()| to_child.flush())
        .map_err(|e| consumer_failed("cannot write to", e))?;
    let mut reply = String::new();
    BufReader::new(from_child.take(1 << 20))
        .read_line(&mut reply)
        .map_err(|e| consumer_failed("cannot read from", e))?;
    if reply.trim().is_empty() {
        drop(to_child);
        let status = child
            .wait()
            .map_err(|e| consumer_failed("cannot wait for", e))?;
        return Err(Failure::Consumer(format!(
            "the consumer answered nothing and exited ({status}); its error is above"
        )));
    }
    let handle: IpcEventHandle = reply.trim().parse()?;

    // Order our check after the consumer's kernel, on the device.
    let done = IpcEvent::open(&device, handle)?;
    done.wait_on(buffer.stream())?;
    let bad = kernels::check_u32(&buffer, PATTERN.mapped(2, 1))?;
    drop(done);
    drop(to_child); // tells the consumer we are done with its event
    let status = child
        .wait()
        .map_err(|e| consumer_failed("cannot wait for", e))?;
    match bad {
        None if status.success() => {
            println!(
                "producer: all {} values were transformed by the consumer",
                size / 4
            );
            Ok(())
        }
        None => Err(Failure::Consumer(format!("the consumer failed ({status})"))),
        Some(i) => Err(Failure::Mismatch(format!(
            "value {i} was not transformed by the consumer"
        ))),
    }
}
