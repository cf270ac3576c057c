//! `cuda-ipc serve` and `cuda-ipc attach`: buffers published by name over
//! the exchange channel (file descriptors over a peer-checked Unix socket,
//! leases), from the command line.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use cuda_ipc::exchange::{Endpoint, Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::SharedBuffer;
use cuda_ipc::{Device, DeviceMemory, Dtype, Error};
use serde_json::json;

use crate::Outcome;

/// Arguments of `serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The socket: a name in the private socket directory
    /// ($XDG_RUNTIME_DIR/cuda-ipc/NAME.sock), or a path (containing a /).
    #[arg(long, default_value = "cuda-ipc")]
    pub socket: String,
    /// Size of each buffer (4096, 64MiB, 1GiB, ...).
    #[arg(long, value_parser = super::parse_size)]
    pub size: u64,
    /// Fill every 32-bit word with this value (decimal or 0x hex).
    #[arg(long, value_parser = super::parse_value)]
    pub fill_u32: u32,
    /// How many buffers to publish (named buf0, buf1, ...).
    #[arg(long, default_value_t = 1)]
    pub buffers: usize,
    /// How to share: auto, legacy, vmm, pool or fabric.
    #[arg(long, value_parser = super::parse_mechanism, default_value = "auto")]
    pub mechanism: super::MechanismArg,
    /// Also let this user id connect (repeatable); by default only our own.
    #[arg(long = "allow-uid")]
    pub allow_uid: Vec<u32>,
    /// After standard input ends, wait this long for subscribers to release.
    #[arg(long, value_parser = super::parse_seconds, default_value = "10")]
    pub release_timeout: Duration,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}

/// Arguments of `attach`.
#[derive(clap::Args, Debug)]
pub struct AttachArgs {
    /// The socket: a name in the private socket directory, or a path.
    #[arg(long, default_value = "cuda-ipc")]
    pub socket: String,
    /// The buffer to attach to (default: the first one published).
    #[arg(long)]
    pub buffer: Option<String>,
    /// Only list the published buffers.
    #[arg(long)]
    pub list: bool,
    /// Check that every 32-bit word equals this value (exit 1 on the first mismatch).
    #[arg(long, value_parser = super::parse_value)]
    pub expect_u32: Option<u32>,
    /// Then fill every 32-bit word with this value.
    #[arg(long, value_parser = super::parse_value)]
    pub fill_u32: Option<u32>,
    /// Accept a publisher running as this user id too (repeatable).
    #[arg(long = "allow-uid")]
    pub allow_uid: Vec<u32>,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}

pub fn serve(args: &ServeArgs) -> Result<Outcome, Error> {
    if args.size == 0 || !args.size.is_multiple_of(4) || args.buffers == 0 {
        return Err(Error::InvalidArgument {
            what: "size or buffers",
            reason: format!(
                "--size ({}) must be a positive multiple of 4 and --buffers ({}) at least 1",
                args.size, args.buffers
            ),
        });
    }
    let device = Device::open(args.device)?;
    let config = PublisherConfig::default().with_allow_uids(args.allow_uid.iter().copied());
    let publisher = Publisher::bind(&device, Endpoint::from(args.socket.as_str()), config)?;
    let mut names = Vec::new();
    let mut mechanism = None;
    for i in 0..args.buffers {
        let buffer = SharedBuffer::alloc(&device, args.size as usize, args.mechanism.0)?;
        mechanism = Some(buffer.mechanism());
        kernels::fill_u32(&buffer, Pattern::constant(args.fill_u32), Speed::Full)?;
        let name = format!("buf{i}");
        publisher.publish(&name, buffer, Dtype::U32, Some(vec![args.size / 4]))?;
        names.push(name);
    }
    let line = json!({
        "socket": publisher.path(),
        "buffers": names,
        "mechanism": mechanism.map(cuda_ipc::Mechanism::name),
        "size": args.size,
        "pid": std::process::id(),
    });
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| Error::Io {
            context: "printing the socket".into(),
            source: e,
        })?;
    drop(out);
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
    let deadline = Instant::now() + args.release_timeout;
    for name in &names {
        let left = deadline.saturating_duration_since(Instant::now());
        publisher.unpublish(name, Some(left))?;
    }
    Ok(Outcome::Ok)
}

pub fn attach(args: &AttachArgs) -> Result<Outcome, Error> {
    let device = Device::open(args.device)?;
    let config = SubscriberConfig::default().with_allow_uids(args.allow_uid.iter().copied());
    let subscriber = Subscriber::connect(&device, Endpoint::from(args.socket.as_str()), config)?;
    let names = subscriber.list()?;
    if args.list {
        for n in &names {
            println!("{n}");
        }
        return Ok(Outcome::Ok);
    }
    let name = match &args.buffer {
        Some(n) => n.clone(),
        None => names
            .first()
            .cloned()
            .ok_or_else(|| Error::InvalidArgument {
                what: "buffer",
                reason: "the publisher publishes nothing".into(),
            })?,
    };
    let started = Instant::now();
    let attached = subscriber.attach::<u8>(&name)?;
    let buffer = attached.buffer();
    buffer.synchronize()?;
    let ms = super::ms_since(started);
    let len = buffer.byte_len() as u64;
    let mut report = format!(
        "attached {name}: {} ({}) in {ms:.3} ms",
        super::human(len),
        attached.descriptor().mechanism()
    );
    if (args.expect_u32.is_some() || args.fill_u32.is_some()) && !len.is_multiple_of(4) {
        return Err(Error::InvalidArgument {
            what: "buffer",
            reason: format!("{len} bytes is not a whole number of 32-bit words"),
        });
    }
    if let Some(want) = args.expect_u32
        && let Some(i) = kernels::check_u32(buffer, Pattern::constant(want))?
    {
        let found: Vec<u32> = buffer.slice(i as usize * 4..i as usize * 4 + 4)?.to_vec()?;
        eprintln!(
            "cuda-ipc: mismatch: word {i} of {name} is {:#010x}, expected {want:#010x}",
            found[0]
        );
        subscriber.release(attached)?;
        return Ok(Outcome::Mismatch);
    }
    if let Some(want) = args.expect_u32 {
        let _ = write!(report, "; all {} words equal {want:#010x}", len / 4);
    }
    if let Some(value) = args.fill_u32 {
        kernels::fill_u32(buffer, Pattern::constant(value), Speed::Full)?;
        let _ = write!(report, "; filled with {value:#010x}");
    }
    subscriber.release(attached)?;
    println!("{report}");
    Ok(Outcome::Ok)
}
