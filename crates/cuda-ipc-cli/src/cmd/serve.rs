//! `cuda-ipc serve` and `cuda-ipc attach`: buffers published by name over
//! the exchange channel (file descriptors over a peer-checked Unix socket,
//! leases), from the command line.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cuda_ipc::arena::{DeviceArenaBuffer, SetMember};
use cuda_ipc::channel::{self, ChannelError, Client, ClientConfig};
use cuda_ipc::exchange::{
    Endpoint, Publisher, PublisherConfig, Sharing, Subscriber, SubscriberConfig,
};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::set;
use cuda_ipc::units::shorten;
use cuda_ipc::{Access, Device, DeviceMemory, Dtype, Error};
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
    #[arg(long, value_parser = super::parse_size, allow_negative_numbers = true, required_unless_present_any = ["checkpoint", "service"])]
    pub size: Option<u64>,
    /// Fill every 32-bit word with this value (decimal or 0x hex).
    #[arg(long, value_parser = super::parse_value, allow_negative_numbers = true, required_unless_present_any = ["set", "checkpoint", "service"])]
    pub fill_u32: Option<u32>,
    /// How many buffers to publish (named buf0, buf1, ...).
    #[arg(long, default_value_t = 1, value_parser = super::parse_count, allow_negative_numbers = true)]
    pub buffers: usize,
    /// Publish one set called `weights` of this many buffers (w0, w1, ...)
    /// from an arena instead, --size bytes in all (sizes drawn from a fixed
    /// seed), each filled with its own ramp that `attach --set` checks.
    #[arg(long, value_parser = super::parse_count, allow_negative_numbers = true, conflicts_with_all = ["fill_u32", "buffers"])]
    pub set: Option<usize>,
    /// Load this safetensors checkpoint (a .safetensors file, a sharded
    /// checkpoint's model.safetensors.index.json, or a model directory)
    /// onto the device and publish its tensors as one set (see --name).
    #[arg(long, conflicts_with_all = ["size", "fill_u32", "buffers", "set"])]
    pub checkpoint: Option<PathBuf>,
    /// The set name a --checkpoint is published under.
    #[arg(long, default_value = "model")]
    pub name: String,
    /// With --checkpoint: load tensor-parallel rank R's shard of N (`--tp
    /// 3/8`) and publish it as NAME.tpR-of-N, each tensor split as the
    /// rules say (docs/SERVICE.md, "Tensor parallel").
    #[arg(long, value_name = "R/N", value_parser = super::parse_tp)]
    pub tp: Option<(u32, u32)>,
    /// With --tp: a rule before the built-in ones (repeatable, first match
    /// wins): tensors whose name contains PATTERN are split along
    /// dimension DIM, or replicated (PATTERN=replicate).
    #[arg(long = "tp-rule", value_name = "PATTERN=DIM", value_parser = super::parse_tp_rule)]
    pub tp_rules: Vec<cuda_ipc::checkpoint::TpRule>,
    /// Streams the --checkpoint copies run on (1 to 1024).
    #[arg(long, default_value_t = 8, value_parser = super::parse_count, allow_negative_numbers = true)]
    pub streams: usize,
    /// The size of each page-locked staging buffer of a --checkpoint load
    /// (two per stream; the largest single copy).
    #[arg(long, default_value = "2MiB", value_parser = super::parse_size, allow_negative_numbers = true)]
    pub staging: u64,
    /// How to share: auto, legacy, vmm, pool or fabric.
    #[arg(long, value_parser = super::parse_mechanism, default_value = "auto")]
    pub mechanism: super::MechanismArg,
    /// Readers map the published set read-only (with --set or
    /// --checkpoint): a reader's kernel or copy that writes through its
    /// mapping fails and the published bytes do not change. Needs vmm
    /// chunks (auto then uses vmm; legacy and pool are refused). A guard
    /// against mistakes, not against a hostile reader of an allowed uid.
    #[arg(long)]
    pub read_only: bool,
    /// Also let this user id connect (repeatable); by default only our own.
    #[arg(long = "allow-uid", value_parser = super::parse_uid, allow_negative_numbers = true)]
    pub allow_uid: Vec<u32>,
    /// After standard input ends, wait this long for subscribers to release
    /// (10s, 500ms, 1m; a number alone counts seconds).
    #[arg(long, value_parser = super::parse_duration, default_value = "10s", allow_negative_numbers = true)]
    pub release_timeout: Duration,
    /// Run as the weight service on this socket (a name in the private
    /// socket directory, default cuda-ipc, or a path): a long-running
    /// process that owns what `cuda-ipc load` loads into it and serves it
    /// as read-only sets (`attach --set`), keeps it when any client exits,
    /// counts it against per-uid quotas (`--quota`, `--quota-uid`), and
    /// stops on SIGTERM or SIGINT (see `--grace`). Standard input is not
    /// read. See `ls`, `stats`, `drop`.
    #[arg(long, value_name = "NAME", num_args = 0..=1, default_missing_value = "cuda-ipc", conflicts_with_all = ["socket", "size", "fill_u32", "buffers", "set", "checkpoint", "read_only"])]
    pub service: Option<String>,
    /// With --service: the bytes each uid other than the service's own may
    /// hold, counting old versions its readers keep (64GiB, ...; `none`: no
    /// limit) [default: a quarter of the device's memory]. The service's own
    /// uid has no limit unless --quota-uid gives it one. A load that would
    /// pass it is refused, naming used, quota and asked.
    #[arg(long, value_name = "BYTES|none", value_parser = super::parse_quota, allow_negative_numbers = true)]
    pub quota: Option<super::QuotaArg>,
    /// With --service: the quota of one uid instead of --quota, as
    /// UID=BYTES (repeatable: 1000=40GiB; the service's own uid too).
    #[arg(long = "quota-uid", value_name = "UID=BYTES", value_parser = super::parse_quota_uid)]
    pub quota_uid: Vec<(u32, u64)>,
    /// With --service: on SIGTERM or SIGINT, wait this long for readers to
    /// release their leases before dropping every set anyway (30s, 2m; a
    /// number alone counts seconds).
    #[arg(long, value_parser = super::parse_duration, default_value = "30s", allow_negative_numbers = true)]
    pub grace: Duration,
    /// With --service: serve without a keeper. By default the command is a
    /// keeper, a small process without CUDA that holds the weights'
    /// descriptors and runs the serving process again at once when it
    /// dies (a crash, SIGKILL; SIGHUP to the keeper runs a new build the
    /// same way), so the sets survive it; under systemd (`$NOTIFY_SOCKET`
    /// set) the unit's file-descriptor store is the keeper. Without one,
    /// the weights die with the process.
    #[arg(long = "no-keeper")]
    pub no_keeper: bool,
    /// With --service: keep a standby serving process started ahead, its
    /// CUDA context made, which takes over at once when the serving one
    /// dies (milliseconds instead of a process start; it costs a second
    /// CUDA context's device memory while it waits).
    #[arg(long, conflicts_with = "no_keeper")]
    pub standby: bool,
    /// With --service: load every .safetensors file of DIR at the start
    /// (what `cuda-ipc save` wrote there), each as the set and version it
    /// was saved from, owned by the file's owner. Sets kept through a
    /// restart are newer and stay as they are.
    #[arg(long, value_name = "DIR")]
    pub restore: Option<std::path::PathBuf>,
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
    /// Only list the published buffers (maps nothing, so takes none of
    /// --buffer, --set, --expect-u32, --fill-u32, --sync, --device).
    #[arg(long, conflicts_with_all = ["buffer", "expect_u32", "fill_u32", "sync", "device"])]
    pub list: bool,
    /// Attach this set (as `serve --set` or `demo --set` publish it) and
    /// check every buffer's values (exit 1 on a mismatch).
    #[arg(long, conflicts_with_all = ["buffer", "list", "expect_u32", "fill_u32"])]
    pub set: Option<String>,
    /// With --set: compare every tensor of the set, byte for byte, with
    /// this safetensors checkpoint (as `serve --checkpoint` publishes it)
    /// instead of checking ramps (exit 1 on a difference).
    #[arg(long, requires = "set")]
    pub checkpoint: Option<PathBuf>,
    /// Check that every 32-bit word equals this value (exit 1 on the first mismatch).
    #[arg(long, value_parser = super::parse_value, allow_negative_numbers = true)]
    pub expect_u32: Option<u32>,
    /// Then fill every 32-bit word with this value.
    #[arg(long, value_parser = super::parse_value, allow_negative_numbers = true)]
    pub fill_u32: Option<u32>,
    /// Accept a publisher running as this user id too (repeatable).
    #[arg(long = "allow-uid", value_parser = super::parse_uid, allow_negative_numbers = true)]
    pub allow_uid: Vec<u32>,
    /// How to wait for the publisher's work: auto (its event where it
    /// opens, else its fence), event, fence (waited for on the GPU), or
    /// host-fence (waited for by this process, no GPU wait operation).
    #[arg(long, default_value = "auto", value_parser = super::parse_sync)]
    pub sync: cuda_ipc::exchange::SyncMode,
    /// Map read-only (vmm memory only; legacy and pool memory are
    /// refused): writing through the mapping fails. A set whose publisher
    /// serves it --read-only is mapped read-only without this.
    #[arg(long, conflicts_with_all = ["fill_u32", "list"])]
    pub read_only: bool,
    /// Device ordinal.
    #[arg(long, default_value_t = 0, value_parser = super::parse_device, allow_negative_numbers = true)]
    pub device: usize,
}

/// The publisher's configuration for `serve` (`--allow-uid`, `--read-only`
/// and the arena of `--mechanism`), checked before the driver is loaded:
/// `--read-only` with `--mechanism legacy` or `pool` is bad input (exit 2).
pub fn publisher_config(args: &ServeArgs) -> Result<PublisherConfig, Error> {
    let config = PublisherConfig::default()
        .with_allow_uids(args.allow_uid.iter().copied())
        .with_sharing(arena_sharing(args.mechanism))
        .with_read_only_readers(args.read_only);
    config.validate()?;
    Ok(config)
}

/// The subscriber's configuration for `attach` (`--allow-uid`, `--sync`,
/// `--read-only`).
pub fn subscriber_config(args: &AttachArgs) -> SubscriberConfig {
    SubscriberConfig::default()
        .with_allow_uids(args.allow_uid.iter().copied())
        .with_sync(args.sync)
        .with_access(Access::read_only_if(args.read_only))
}

/// How a mapping is mapped, for reports: `read-only` or `read-write`.
pub fn access_word(read_only: bool) -> &'static str {
    Access::read_only_if(read_only).name()
}

/// The longest path a Unix socket address holds (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Which side is about to use a socket path.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// `serve`: binds a new socket there.
    Serve,
    /// `attach`: connects to a socket that must be there.
    Attach,
}

/// Resolves `--socket` and checks what is at the path, before the driver is
/// loaded: an empty or bad name, a path too long for a socket, or a file or
/// directory where the socket should be is bad input (exit 2), and a missing
/// socket for `attach` says that nothing serves there.
pub fn socket_path(socket: &str, side: Side) -> Result<PathBuf, Error> {
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

/// The seed of the set mode's buffer sizes (`set::weight_sizes`).
pub const SET_SEED: u64 = 0x5E7_5EED;

/// The name `serve --set` and `demo --set` publish their set under.
pub const SET_NAME: &str = "weights";

/// The values of buffer `i` of a CLI set: a ramp that starts differently
/// for every buffer, so that a view of the wrong buffer fails the check.
pub fn set_pattern(i: usize) -> Pattern {
    Pattern::ramp((i as u32).wrapping_mul(0x0100_0193) ^ 0x5E7D_A7A0, 1)
}

/// The sizes of a CLI set of `n` buffers, `total` bytes in all.
pub fn set_sizes(n: usize, total: u64) -> Result<Vec<u64>, Error> {
    set::weight_sizes(n, total, SET_SEED).map_err(|e| Error::InvalidArgument {
        what: "--set or --size",
        reason: format!("cannot draw {n} buffers of {total} bytes in all: {e}"),
    })
}

/// Publishes the CLI's set of `sizes.len()` buffers, each filled with its
/// ramp, from the publisher's arena; returns the buffers (the producer's
/// handles).
pub fn publish_set(publisher: &Publisher, sizes: &[u64]) -> Result<Vec<DeviceArenaBuffer>, Error> {
    let total: u64 = sizes.iter().sum();
    publisher.arena()?.reserve(total)?;
    let mut buffers = Vec::with_capacity(sizes.len());
    for (i, len) in sizes.iter().enumerate() {
        let b = publisher.alloc(*len)?;
        kernels::fill_u32(&b, set_pattern(i), Speed::Full)?;
        buffers.push(b);
    }
    let names: Vec<String> = (0..sizes.len()).map(|i| format!("w{i}")).collect();
    let shapes: Vec<[u64; 1]> = sizes.iter().map(|l| [l / 4]).collect();
    let members: Vec<SetMember<'_>> = buffers
        .iter()
        .zip(&names)
        .zip(&shapes)
        .map(|((buffer, name), shape)| SetMember::new(name, Dtype::U32, shape, buffer))
        .collect();
    publisher.publish_set(SET_NAME, &members)?;
    Ok(buffers)
}

/// The sharing a `--mechanism` asks for, from an arena.
pub fn arena_sharing(mechanism: super::MechanismArg) -> Sharing {
    match mechanism.0 {
        Some(m) => Sharing::arena(m),
        None => Sharing::auto(),
    }
}

/// `--size`, which clap requires unless `--checkpoint` is given.
fn size_of(args: &ServeArgs) -> Result<u64, Error> {
    args.size.ok_or_else(|| Error::InvalidArgument {
        what: "--size",
        reason: "it is required (unless --checkpoint is given)".into(),
    })
}

fn serve_set(args: &ServeArgs, n: usize) -> Result<Outcome, Error> {
    let size = size_of(args)?;
    let sizes = set_sizes(n, size)?;
    let path = socket_path(&args.socket, Side::Serve)?;
    let config = publisher_config(args)?;
    let device = Device::open(args.device)?;
    let publisher = Publisher::bind(&device, Endpoint::Path(path), config)?;
    let buffers = publish_set(&publisher, &sizes)?;
    let line = json!({
        "socket": publisher.path(),
        "set": SET_NAME,
        "buffers": n,
        "mechanism": publisher.arena()?.backing().mechanism().name(),
        "read_only": publisher.read_only_readers(),
        "size": size,
        "pid": std::process::id(),
    });
    outln!("{line}")?;
    super::wait_for_stdin_end()?;
    publisher.unpublish_set(SET_NAME, Some(args.release_timeout))?;
    drop(buffers);
    publisher.trim()?;
    Ok(Outcome::Ok)
}

pub fn serve(args: &ServeArgs) -> Result<Outcome, Error> {
    if let Some(n) = args.set {
        return serve_set(args, n);
    }
    if args.read_only {
        return Err(Error::InvalidArgument {
            what: "--read-only",
            reason: "it applies to sets (--set or --checkpoint), whose record carries it; \
                     buffers published one by one are mapped as each reader asks \
                     (`attach --read-only`)"
                .into(),
        });
    }
    let size = size_of(args)?;
    if size == 0 || !size.is_multiple_of(4) || args.buffers == 0 {
        return Err(Error::InvalidArgument {
            what: "size or buffers",
            reason: format!(
                "--size ({}) must be a positive multiple of 4 and --buffers ({}) at least 1",
                size, args.buffers
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
        let fill = args.fill_u32.unwrap_or_default(); // required without --set
        let buffer = super::alloc_filled(&device, size, args.mechanism, fill)?;
        mechanism = Some(buffer.mechanism());
        let name = format!("buf{i}");
        publisher.publish(&name, buffer, Dtype::U32, Some(vec![size / 4]))?;
        names.push(name);
    }
    let line = json!({
        "socket": publisher.path(),
        "buffers": names,
        "mechanism": mechanism.map(cuda_ipc::Mechanism::name),
        "size": size,
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
        if entry
            .name
            .starts_with(cuda_ipc::exchange::HIDDEN_ENTRY_PREFIX)
        {
            continue; // an arena chunk or a part of a set record
        }
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
    let config = subscriber_config(args);
    let subscriber = Subscriber::connect(&device, Endpoint::Path(path), config)?;
    if let Some(set) = &args.set {
        return attach_set(&subscriber, set);
    }
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
        "attached {name}: {} ({}, {}, synchronised with the publisher's {}) in {ms:.3} ms",
        super::human(len),
        attached.descriptor().mechanism(),
        access_word(attached.read_only()),
        if attached.uses_fence() {
            "fence"
        } else {
            "event"
        }
    );
    if args.fill_u32.is_some() && attached.read_only() {
        subscriber.release(attached)?;
        return Err(Error::InvalidArgument {
            what: "--fill-u32",
            reason: format!(
                "{name} is mapped read-only (its publisher serves it --read-only), so it cannot \
                 be filled; attach it without --fill-u32"
            ),
        });
    }
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

/// `attach --set NAME`: attaches the set and checks every buffer's ramp.
pub fn attach_set(subscriber: &Subscriber, name: &str) -> Result<Outcome, Error> {
    let started = Instant::now();
    let set = subscriber.attach_set(name)?;
    // Every view of the set shares the device stream that waited on the event.
    set.view::<u8>(0)?.synchronize()?;
    let ms = super::ms_since(started);
    let t = Instant::now();
    for i in 0..set.len() {
        let view = set.view::<u32>(i)?;
        if let Some(w) = kernels::check_u32(&view, set_pattern(i))? {
            let found: Vec<u32> = view.slice(w as usize..w as usize + 1)?.to_vec()?;
            errln!(
                "cuda-ipc: mismatch: word {w} of {}/{} is {:#010x}, expected {:#010x}",
                name,
                set.entries()[i].name,
                found[0],
                set_pattern(i).at(w)
            );
            drop(view);
            subscriber.release_set(set)?;
            return Ok(Outcome::Mismatch);
        }
    }
    let check_ms = super::ms_since(t);
    let bytes = set.record().total_bytes();
    let n = set.len();
    let access = access_word(set.read_only());
    subscriber.release_set(set)?;
    outln!(
        "attached set {name}: {n} buffers, {} ({access}) in {ms:.3} ms; every value of every buffer checked in {check_ms:.3} ms",
        super::human(bytes)
    )?;
    Ok(Outcome::Ok)
}
