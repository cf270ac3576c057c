//! `cuda-ipc serve` and `cuda-ipc attach`: buffers published by name over
//! the exchange channel (file descriptors over a peer-checked Unix socket,
//! leases), from the command line.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cuda_ipc::channel::{self, ChannelError, Client, ClientConfig};
use cuda_ipc::exchange::{Endpoint, Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::units::shorten;
use cuda_ipc::{Device, DeviceMemory, Dtype, Error};
use rustix::fs::FileType;
use rustix::io::Errno;
use serde_json::json;

use crate::Outcome;
use crate::out::{errln, outln};

/// Arguments of `serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The socket: a name in the private socket directory
    /// ($XDG_RUNTIME_DIR/cuda-ipc/NAME.sock), or a path (containing a /).
    #[arg(long, default_value = "cuda-ipc")]
    pub socket: String,
    /// Size of each buffer (4096, 64MiB, 1GiB, ...).
    #[arg(long, value_parser = super::parse_size, allow_negative_numbers = true)]
    pub size: u64,
    /// Fill every 32-bit word with this value (decimal or 0x hex).
    #[arg(long, value_parser = super::parse_value, allow_negative_numbers = true)]
    pub fill_u32: u32,
    /// How many buffers to publish (named buf0, buf1, ...).
    #[arg(long, default_value_t = 1, value_parser = super::parse_count, allow_negative_numbers = true)]
    pub buffers: usize,
    /// How to share: auto, legacy, vmm, pool or fabric.
    #[arg(long, value_parser = super::parse_mechanism, default_value = "auto")]
    pub mechanism: super::MechanismArg,
    /// Also let this user id connect (repeatable); by default only our own.
    #[arg(long = "allow-uid", value_parser = super::parse_uid, allow_negative_numbers = true)]
    pub allow_uid: Vec<u32>,
    /// After standard input ends, wait this long for subscribers to release
    /// (10s, 500ms, 1m; a number alone counts seconds).
    #[arg(long, value_parser = super::parse_duration, default_value = "10s", allow_negative_numbers = true)]
    pub release_timeout: Duration,
    /// Device ordinal.
    #[arg(long, default_value_t = 0, value_parser = super::parse_device, allow_negative_numbers = true)]
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
    #[arg(long, value_parser = super::parse_value, allow_negative_numbers = true)]
    pub expect_u32: Option<u32>,
    /// Then fill every 32-bit word with this value.
    #[arg(long, value_parser = super::parse_value, allow_negative_numbers = true)]
    pub fill_u32: Option<u32>,
    /// Accept a publisher running as this user id too (repeatable).
    #[arg(long = "allow-uid", value_parser = super::parse_uid, allow_negative_numbers = true)]
    pub allow_uid: Vec<u32>,
    /// Device ordinal.
    #[arg(long, default_value_t = 0, value_parser = super::parse_device, allow_negative_numbers = true)]
    pub device: usize,
}

/// The longest path a Unix socket address holds (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Which side is about to use a socket path.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    /// `serve`: binds a new socket there.
    Serve,
    /// `attach`: connects to a socket that must be there.
    Attach,
}

/// Resolves `--socket` and checks what is at the path, before the driver is
/// loaded: an empty or bad name, a path too long for a socket, or a file or
/// directory where the socket should be is bad input (exit 2), and a missing
/// socket for `attach` says that nothing serves there.
fn socket_path(socket: &str, side: Side) -> Result<PathBuf, Error> {
    let bad = |reason: String| Error::InvalidArgument {
        what: "--socket",
        reason,
    };
    if socket.is_empty() {
        return Err(bad(
            "it is empty; give a name (letters, digits, '.', '_' and '-') or a path containing a /"
                .into(),
        ));
    }
    let path = match Endpoint::from(socket) {
        Endpoint::Name(name) => {
            if let Err(e) = channel::validate_socket_name(&name) {
                let reason = match e {
                    ChannelError::InvalidName { reason, .. } => reason,
                    other => other.to_string(),
                };
                return Err(bad(format!(
                    "{} is not a socket name: {reason}; or give a path containing a /",
                    shorten(&name, 40)
                )));
            }
            channel::default_socket_path(&name)?
        }
        Endpoint::Path(path) => path,
        other => other.path()?,
    };
    let shown = shorten(&path.to_string_lossy(), 80);
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(bad(format!(
            "{shown} is {len} bytes long, but a Unix socket path has at most {MAX_SOCKET_PATH}; \
             choose a shorter path"
        )));
    }
    match rustix::fs::lstat(&path) {
        Ok(st) => {
            let kind = match FileType::from_raw_mode(st.st_mode) {
                FileType::Socket => return Ok(path),
                FileType::RegularFile => "a regular file",
                FileType::Directory => "a directory",
                FileType::Symlink => "a symbolic link",
                FileType::Fifo => "a FIFO",
                _ => "a device file",
            };
            Err(bad(match side {
                Side::Serve => format!(
                    "{shown} is {kind}, not a socket; refusing to replace it: remove it or \
                     choose another path"
                ),
                Side::Attach => format!(
                    "{shown} is {kind}, not a socket; give the socket that `cuda-ipc serve` \
                     printed"
                ),
            }))
        }
        Err(Errno::NOENT) if side == Side::Serve => {
            let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
            match parent {
                Some(dir) if !dir.is_dir() => Err(bad(format!(
                    "the directory {} does not exist; create it or choose another path",
                    shorten(&dir.to_string_lossy(), 80)
                ))),
                _ => Ok(path),
            }
        }
        Err(Errno::NOENT) => Err(Error::Io {
            context: format!(
                "no socket at {shown}: nothing serves there; start `cuda-ipc serve` first, \
                 or check the path"
            ),
            source: Errno::NOENT.into(),
        }),
        Err(Errno::NOTDIR) => Err(bad(format!(
            "a component of {shown} is not a directory; check the path"
        ))),
        Err(e) => Err(Error::Io {
            context: format!("cannot inspect the socket {shown}"),
            source: e.into(),
        }),
    }
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
    let path = socket_path(&args.socket, Side::Serve)?;
    let device = Device::open(args.device)?;
    let config = PublisherConfig::default().with_allow_uids(args.allow_uid.iter().copied());
    let publisher = Publisher::bind(&device, Endpoint::Path(path), config)?;
    let mut names = Vec::new();
    let mut mechanism = None;
    for i in 0..args.buffers {
        let buffer = super::alloc_filled(&device, args.size, args.mechanism, args.fill_u32)?;
        mechanism = Some(buffer.mechanism());
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
    outln!("{line}")?;
    super::wait_for_stdin_end()?;
    // The timeout is at most 30 days (the parser's limit), so this never
    // overflows; the check keeps it that way if the limit changes.
    let deadline = Instant::now()
        .checked_add(args.release_timeout)
        .ok_or_else(|| Error::InvalidArgument {
            what: "--release-timeout",
            reason: format!("{:?} is too long", args.release_timeout),
        })?;
    for name in &names {
        let left = deadline.saturating_duration_since(Instant::now());
        publisher.unpublish(name, Some(left))?;
    }
    Ok(Outcome::Ok)
}

/// `attach --list`: the channel alone, no GPU needed.
fn list(path: &Path, allow_uids: &[u32]) -> Result<Outcome, Error> {
    let mut config = ClientConfig::default();
    config.allowed_server_uids.extend_from_slice(allow_uids);
    let client = Client::connect(path, config)?;
    for entry in client.list()? {
        outln!("{}", entry.name)?;
    }
    Ok(Outcome::Ok)
}

pub fn attach(args: &AttachArgs) -> Result<Outcome, Error> {
    let path = socket_path(&args.socket, Side::Attach)?;
    if args.list {
        return list(&path, &args.allow_uid);
    }
    let device = Device::open(args.device)?;
    let config = SubscriberConfig::default().with_allow_uids(args.allow_uid.iter().copied());
    let subscriber = Subscriber::connect(&device, Endpoint::Path(path), config)?;
    let names = subscriber.list()?;
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
    if args.expect_u32.is_some() || args.fill_u32.is_some() {
        super::check_words(len, "buffer")?;
    }
    if let Some(want) = args.expect_u32
        && let Some(i) = kernels::check_u32(buffer, Pattern::constant(want))?
    {
        let found: Vec<u32> = buffer.slice(i as usize * 4..i as usize * 4 + 4)?.to_vec()?;
        errln!(
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
    outln!("{report}")?;
    Ok(Outcome::Ok)
}
