//! One module per subcommand.

pub mod checkpoint;
pub mod demo;
pub mod demo_args;
pub mod export;
pub mod info;
pub mod keeper;
pub mod open;
pub mod save;
pub mod serve;
pub mod service;
pub mod service_client;
pub mod stream;

use std::ffi::OsStr;
use std::io::Read;
use std::process::{Child, Stdio};
use std::time::Instant;

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::SharedBuffer;
use cuda_ipc::{Device, Error};
use cuda_ipc_bench::namespaces::ConsumerNamespaces;

/// Milliseconds since `t`.
pub fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Parses a size with units for clap.
pub fn parse_size(s: &str) -> Result<u64, String> {
    s.parse::<cuda_ipc::units::ByteSize>()
        .map(|b| b.0)
        .map_err(|e| e.to_string())
}

/// Parses a 32-bit value (decimal or 0x hex) for clap.
pub fn parse_value(s: &str) -> Result<u32, String> {
    cuda_ipc::units::parse_u32(s).map_err(|e| e.to_string())
}

/// Parses a non-negative whole number for clap; `what` says what it counts
/// and `example` shows one.
fn parse_whole<T: std::str::FromStr>(s: &str, what: &str, example: &str) -> Result<T, String> {
    let shown = cuda_ipc::units::shorten(s, 40);
    let t = s.trim();
    if t.starts_with('-') && t.len() > 1 {
        return Err(format!("{shown} is negative; {what} must be non-negative"));
    }
    t.parse().map_err(|_| {
        format!("{shown} is not {what}; expected a non-negative whole number such as {example}")
    })
}

/// Parses a device ordinal (`--device`) for clap.
pub fn parse_device(s: &str) -> Result<usize, String> {
    parse_whole(
        s,
        "a device ordinal",
        "0 or 1 (`cuda-ipc info` lists the devices)",
    )
}

/// Parses a user id (`--allow-uid`) for clap.
pub fn parse_uid(s: &str) -> Result<u32, String> {
    parse_whole(s, "a user id", "1000 (`id -u` prints yours)")
}

/// Parses `--quota-uid UID=BYTES` for clap.
pub fn parse_quota_uid(s: &str) -> Result<(u32, u64), String> {
    let shown = cuda_ipc::units::shorten(s, 40);
    let Some((uid, bytes)) = s.split_once('=') else {
        return Err(format!(
            "{shown} is not UID=BYTES; write for example 1000=40GiB"
        ));
    };
    let uid = parse_uid(uid)?;
    let bytes = parse_size(bytes)?;
    Ok((uid, bytes))
}

/// `--quota`: a byte count, or `none` for no limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuotaArg {
    /// At most this many bytes.
    Bytes(u64),
    /// No limit.
    Unlimited,
}

/// Parses `--quota BYTES|none` for clap.
pub fn parse_quota(s: &str) -> Result<QuotaArg, String> {
    if s.trim().eq_ignore_ascii_case("none") {
        return Ok(QuotaArg::Unlimited);
    }
    parse_size(s)
        .map(QuotaArg::Bytes)
        .map_err(|e| format!("{e} (or `none` for no limit)"))
}

/// Parses `--tp R/N` for clap.
pub fn parse_tp(s: &str) -> Result<(u32, u32), String> {
    let bad = || {
        format!(
            "{} is not R/N; write for example 3/8 (rank 3 of 8 ranks)",
            cuda_ipc::units::shorten(s, 40)
        )
    };
    let (rank, world) = s.split_once('/').ok_or_else(bad)?;
    let (rank, world) = (
        rank.parse().map_err(|_| bad())?,
        world.parse().map_err(|_| bad())?,
    );
    cuda_ipc::checkpoint::shard_name("x", rank, world).map_err(|e| e.to_string())?;
    Ok((rank, world))
}

/// Parses `--tp-rule PATTERN=DIM` or `PATTERN=replicate` for clap.
pub fn parse_tp_rule(s: &str) -> Result<cuda_ipc::checkpoint::TpRule, String> {
    s.parse().map_err(|e: cuda_ipc::Error| e.to_string())
}

/// Parses a count of things (`--buffers`, `--slots`) for clap.
pub fn parse_count(s: &str) -> Result<usize, String> {
    parse_whole(s, "a count", "8")
}

/// `--mechanism`: `auto` (the best the device supports) or one mechanism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MechanismArg(pub Option<cuda_ipc::Mechanism>);

/// Parses a mechanism name (or `auto`), in any letter case, for clap.
pub fn parse_mechanism(s: &str) -> Result<MechanismArg, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "auto" => Ok(MechanismArg(None)),
        name => name.parse().map(|m| MechanismArg(Some(m))).map_err(|_| {
            format!(
                "{} is not one of auto, legacy, vmm, pool, fabric",
                cuda_ipc::units::shorten(s, 40)
            )
        }),
    }
}

/// Parses a sync mode (`--sync`: auto, event, fence, host-fence), in any
/// letter case, for clap.
pub fn parse_sync(s: &str) -> Result<cuda_ipc::exchange::SyncMode, String> {
    s.trim().to_ascii_lowercase().parse().map_err(|_| {
        format!(
            "{} is not one of auto, event, fence, host-fence",
            cuda_ipc::units::shorten(s, 40)
        )
    })
}

/// Parses a duration with units (`10s`, `500ms`, `1m`; a number alone
/// counts seconds) for clap.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    s.parse::<cuda_ipc::units::Duration>()
        .map(|d| d.0)
        .map_err(|e| e.to_string())
}

/// Checks `--consumer-namespaces` before the driver is touched: a name
/// given twice is bad input (exit 2); namespaces that cannot be created
/// here (no `unshare`, not root) are unavailable (exit 3).
pub fn consumer_namespaces(
    list: &[cuda_ipc_bench::namespaces::Namespace],
) -> Result<ConsumerNamespaces, Error> {
    let namespaces = ConsumerNamespaces::new(list).map_err(|reason| Error::InvalidArgument {
        what: "consumer namespaces",
        reason,
    })?;
    namespaces.check_allowed()?;
    Ok(namespaces)
}

/// Allocates a shared buffer of `size` bytes and fills every 32-bit word
/// with `value` (queued on the buffer's stream).
pub fn alloc_filled(
    device: &Device,
    size: u64,
    mechanism: MechanismArg,
    value: u32,
) -> Result<SharedBuffer, Error> {
    let buffer = SharedBuffer::alloc(device, size as usize, mechanism.0)?;
    kernels::fill_u32(&buffer, Pattern::constant(value), Speed::Full)?;
    Ok(buffer)
}

/// Returns when standard input ends: how `export` and `serve` learn that
/// their caller is done with the memory.
pub fn wait_for_stdin_end() -> Result<(), Error> {
    let mut sink = [0u8; 4096];
    let mut stdin = std::io::stdin().lock();
    loop {
        match stdin.read(&mut sink) {
            Ok(0) => return Ok(()),
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
}

/// This program, started again with `args` (the hidden child roles of
/// `demo` and `info`), its standard output piped; `role` names it in errors.
pub fn spawn_self<A: AsRef<OsStr>>(role: &str, args: &[A], stdin: Stdio) -> Result<Child, Error> {
    spawn_self_in(&ConsumerNamespaces::default(), role, args, stdin)
}

/// [`spawn_self`] in new namespaces (`--consumer-namespaces`; none: ours).
pub fn spawn_self_in<A: AsRef<OsStr>>(
    namespaces: &ConsumerNamespaces,
    role: &str,
    args: &[A],
    stdin: Stdio,
) -> Result<Child, Error> {
    let exe = std::env::current_exe().map_err(|e| Error::Io {
        context: "finding our own executable".into(),
        source: e,
    })?;
    namespaces
        .command(exe)
        .args(args)
        .stdin(stdin)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| Error::Io {
            context: format!("starting the {role} process"),
            source: e,
        })
}

/// Checks that a region of `len` bytes is whole 32-bit words before
/// `--expect-u32` or `--fill-u32` works on it.
pub fn check_words(len: u64, what: &'static str) -> Result<(), Error> {
    if len.is_multiple_of(4) {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        what,
        reason: format!("{len} bytes is not a whole number of 32-bit words"),
    })
}

/// Nanoseconds of CLOCK_MONOTONIC, comparable between processes of one machine.
pub fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// A byte count in binary units for people.
pub fn human(n: u64) -> String {
    cuda_ipc::units::ByteSize(n).to_string()
}

#[cfg(test)]
mod tests {
    use super::{QuotaArg, parse_quota, parse_quota_uid};

    #[test]
    fn a_quota_is_bytes_or_none() {
        assert_eq!(parse_quota("16GiB"), Ok(QuotaArg::Bytes(16 << 30)));
        assert_eq!(parse_quota("None"), Ok(QuotaArg::Unlimited));
        let e = parse_quota("lots").unwrap_err();
        assert!(e.contains("lots") && e.contains("none"), "{e}");
    }

    #[test]
    fn quota_uids_are_uid_equals_bytes() {
        assert_eq!(parse_quota_uid("1000=1GiB"), Ok((1000, 1 << 30)));
        assert_eq!(parse_quota_uid("0=4096"), Ok((0, 4096)));
        for (bad, why) in [
            ("1000", "not UID=BYTES"),
            ("x=1GiB", "not a user id"),
            ("-1=1GiB", "negative"),
            ("1000=lots", "lots"),
        ] {
            let e = parse_quota_uid(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
