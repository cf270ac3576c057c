//! The consumer process of `bench` (`cuda-ipc __bench-worker`): opens the
//! device, says `{"ready": true}`, then answers one JSON line per request
//! read from standard input until `{"op": "bye"}` or the end of input.
//!
//! Requests (each answered by one line, `{"error": "..."}` on failure):
//! - `connect {socket}`: connect a [`Subscriber`];
//! - `ping`: `{t_recv}` (the pipe's one-way time);
//! - `attach {name, base, step}`: attach, synchronise, note the time,
//!   check a few words, release: `{t_recv, t_done, verify_ms, release_ms}`;
//! - `hold {name, base, step}` / `drop {name}`: attach and keep / release;
//! - `await {name, base, step}`: answers `{waiting}` first, then waits for
//!   the next update, synchronises: `{t_recv, t_done, verify_ms}`;
//! - `hold_many {prefix, count}` / `drop_all`;
//! - `floor_setup {event, socket}`, `floor_legacy {handle, base, step}`,
//!   `floor_vmm {name, size, len, base, step[, also]}`: the driver floor
//!   (`also`: another GPU the VMM mapping grants access to);
//! - `wake_setup {name, capacity}`, `wake_wait {spin_us}`: the wake-up
//!   floor (a notice through shared memory, read when it comes: `{t_wake,
//!   slept}`);
//! - `bandwidth {name, warmup, reps, base, step[, peer_device]}`: copies
//!   timed with CUDA events (with `peer_device`, also cuMemcpyPeer from a
//!   buffer on that GPU), the data checked both ways;
//! - `ring {name, verify_every}`: answers `{subscribed}` first, then takes
//!   frames until one says `stop`;
//! - `set_attach {name, base, step}`: attach a set, synchronise, note the
//!   time, check every buffer, release: `{t_recv, t_done, verify_ms,
//!   entries, cached_mappings}`; `set_hold {name, base, step}` /
//!   `set_drop {name}`: attach and keep / release; `set_await {name, base,
//!   step}`: answers `{waiting}` first, then waits for the set's next
//!   update, synchronises: `{t_recv, t_done, version, verify_ms}`.
//!
//! Reading standard input is a plain blocking read on this thread, so a
//! request wakes the consumer with no thread hop (with
//! `CUDA_IPC_BENCH_AWAKE_US` set, the thread polls the input that long
//! first, awake); if the producer dies the input ends and the consumer
//! exits.

use std::collections::HashMap;
use std::io::BufRead;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use cuda_ipc::channel;
use cuda_ipc::exchange::{Attachment, SetAttachment, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::Pattern;
use cuda_ipc::{Device, DeviceMemory, Error, IpcEvent, LegacyBuffer};
use serde_json::{Value, json};

use super::proto::{failure, mono_ns, send_line};

mod copies;
mod push;
mod ring;
pub(crate) mod wake;

/// Arguments of the hidden consumer.
#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}

/// How long a consumer waits for an update or a ring frame.
const WAIT: Duration = Duration::from_secs(30);

/// The consumer process.
pub fn worker(args: &WorkerArgs) -> Result<(), Error> {
    super::raise_open_files_limit();
    let mut out = std::io::stdout().lock();
    // Read through a descriptor of its own, so that what is buffered is
    // known here (`poll_readable` looks at the descriptor only).
    let mut input = std::io::BufReader::new(std::fs::File::from(
        std::io::stdin()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| Error::Io {
                context: "duplicating standard input".into(),
                source: e,
            })?,
    ));
    let started = Instant::now();
    let device = match Device::open(args.device) {
        Ok(d) => d,
        Err(e) => {
            send_line(
                &mut out,
                &json!({ "error": format!("opening the device: {e}") }),
            )?;
            return Ok(());
        }
    };
    send_line(
        &mut out,
        &json!({
            "ready": true,
            "startup_ms": started.elapsed().as_secs_f64() * 1e3,
            "pid": std::process::id(),
        }),
    )?;
    let mut state = State {
        device,
        sub: None,
        held: HashMap::new(),
        floor: None,
        local: None,
        remote: None,
        sets: HashMap::new(),
        wake: None,
        socket: None,
        stream: None,
    };
    let mut line = String::new();
    loop {
        line.clear();
        if input.buffer().is_empty() {
            crate::lines::poll_readable(input.get_ref().as_fd(), crate::lines::awake_spin());
        }
        let n = input.read_line(&mut line).map_err(|e| Error::Io {
            context: "reading the producer's request".into(),
            source: e,
        })?;
        let t_recv = mono_ns();
        if n == 0 {
            break; // the producer closed our input (or exited)
        }
        let request: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                send_line(
                    &mut out,
                    &json!({ "error": format!("not JSON ({e}): {line:?}") }),
                )?;
                continue;
            }
        };
        let op = request["op"].as_str().unwrap_or("").to_string();
        if op == "bye" {
            break;
        }
        let answer = state
            .handle(&op, &request, t_recv, &mut out)
            .unwrap_or_else(|e| json!({ "error": format!("{op}: {e}") }));
        send_line(&mut out, &answer)?;
    }
    Ok(())
}

/// What the driver floor keeps between requests.
struct Floor {
    event: IpcEvent,
    client: channel::Client,
    granularity: u64,
}

struct State {
    device: Device,
    sub: Option<Subscriber>,
    held: HashMap<String, Attachment<u32>>,
    floor: Option<Floor>,
    /// Two local buffers for the bandwidth copies.
    local: Option<(LegacyBuffer, LegacyBuffer)>,
    /// For cuMemcpyPeer: the other GPU, and a buffer there.
    remote: Option<(Device, LegacyBuffer)>,
    /// Sets attached and kept (`set_hold`).
    sets: HashMap<String, SetAttachment>,
    /// The wake-up floor's ring (`wake_setup`).
    wake: Option<wake::Wake>,
    /// The socket of `connect`, for `respin`.
    socket: Option<String>,
    /// The stream the push section pushes to (`push_subscribe`).
    stream: Option<cuda_ipc::exchange::Stream>,
}

fn text<'a>(v: &'a Value, key: &str) -> Result<&'a str, Error> {
    v.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| failure("the request", format!("no string {key:?} in {v}")))
}

fn int(v: &Value, key: &str) -> Result<u64, Error> {
    super::proto::get_u64(v, key)
}

fn pattern(v: &Value) -> Result<Pattern, Error> {
    Ok(Pattern::ramp(
        int(v, "base")? as u32,
        int(v, "step")? as u32,
    ))
}

/// Checks the first and last four words of `memory` against `pattern`;
/// `Some(description)` of the first mismatch.
pub fn verify<M: DeviceMemory>(memory: &M, pattern: Pattern) -> Result<Option<String>, Error> {
    let words = (memory.byte_len() / 4) as u64;
    let k = words.min(4);
    for first in [0, words - k] {
        let got: Vec<u32> = memory.region(first * 4, k * 4)?.to_vec()?;
        for (i, g) in got.iter().enumerate() {
            let at = first + i as u64;
            if *g != pattern.at(at) {
                return Ok(Some(format!(
                    "word {at} is {g:#010x}, the producer wrote {:#010x}",
                    pattern.at(at)
                )));
            }
        }
    }
    Ok(None)
}

/// The pattern of buffer `j` of a set filled with `p`: distinct per
/// buffer, so a view at the wrong offset is caught.
pub fn entry_pattern(p: Pattern, j: usize) -> Pattern {
    Pattern::ramp(
        p.base.wrapping_add((j as u32).wrapping_mul(0x9E37_79B9)),
        p.step,
    )
}

/// Checks the first and last words of every buffer of `set` against its
/// pattern of `p` (the views are dropped before this returns); with
/// [`pad_launches`] above the set's size, buffer 0 is checked again until
/// that many buffers were.
fn check_set(set: &SetAttachment, p: Pattern) -> Result<(), Error> {
    for j in padded(set.len()) {
        let view = set.view::<u32>(j)?;
        if let Some(m) = verify(&view, entry_pattern(p, j))? {
            return Err(mismatch(&format!("buffer {j} of set {:?}", set.name()), &m));
        }
    }
    Ok(())
}

/// A diagnostic: `CUDA_IPC_BENCH_PAD=N` makes every weight set's fill (the
/// producer) and check (the consumer) work on at least N buffers, the
/// first buffer again for a set of fewer, so that the work done between
/// two samples, and what it leaves in the CPU's caches and the driver,
/// is that of a set of N whatever the set's size. Unset (0): no padding.
/// The bench checks the variable before it starts ([`parse_pad`]), so a
/// value that does not parse never reaches a worker; there it counts as 0.
pub fn pad_launches() -> usize {
    static PAD: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAD.get_or_init(|| {
        parse_pad(std::env::var_os(PAD_VAR).as_deref())
            .ok()
            .unwrap_or(0)
    })
}

/// The variable of [`pad_launches`].
pub const PAD_VAR: &str = "CUDA_IPC_BENCH_PAD";

/// Parses `CUDA_IPC_BENCH_PAD`'s value: unset or empty is 0, otherwise a
/// whole number of buffers up to 1,000,000.
#[allow(clippy::unnecessary_debug_formatting)] // quoted, with escapes: the value as given
pub fn parse_pad(value: Option<&std::ffi::OsStr>) -> Result<usize, String> {
    const MAX: usize = 1_000_000;
    let Some(value) = value else { return Ok(0) };
    let text = value.to_str().map_or("?", str::trim);
    if text.is_empty() {
        return Ok(0);
    }
    match text.parse::<usize>() {
        Ok(n) if n <= MAX => Ok(n),
        _ => Err(format!(
            "{PAD_VAR}={value:?} is not a whole number of buffers from 0 to {MAX}; unset it, or \
             give how many buffers every weight set's fill and check should work on"
        )),
    }
}

/// The buffer indices a set of `len` buffers is filled or checked at:
/// each once, then buffer 0 again up to [`pad_launches`].
pub fn padded(len: usize) -> impl Iterator<Item = usize> {
    (0..len).chain(std::iter::repeat_n(0, pad_launches().saturating_sub(len)))
}

/// Synchronises `buffer` and adds the time it took to `phases` (a
/// library call's, `{phase: µs}`) as `synchronize`.
///
/// With `CUDA_IPC_BENCH_PROBE=1` (a diagnosis, not for figures: it adds
/// to the clock) it first records an event on the buffer's stream and
/// queries it (`probe: busy`, 1 when work was still queued there, and
/// `probe: query`, µs), and after the synchronize times a second one
/// (`probe: again`).
fn with_synchronize(mut phases: Value, buffer: &impl DeviceMemory) -> Result<Value, Error> {
    let probe = probing()
        .then(|| -> Result<(f64, f64), Error> {
            let t = Instant::now();
            let e = buffer
                .stream()
                .record_event(None)
                .map_err(|e| failure("the probe's event", e.to_string()))?;
            let busy = !e.is_complete();
            Ok((f64::from(u8::from(busy)), t.elapsed().as_secs_f64() * 1e6))
        })
        .transpose()?;
    let t = Instant::now();
    buffer.synchronize()?;
    let took = t.elapsed().as_secs_f64() * 1e6;
    if let Some(p) = phases.as_object_mut() {
        p.insert("synchronize".into(), json!(took));
        if let Some((busy, query)) = probe {
            let t = Instant::now();
            buffer.synchronize()?;
            p.insert("probe: busy".into(), json!(busy));
            p.insert("probe: query".into(), json!(query));
            p.insert(
                "probe: again".into(),
                json!(t.elapsed().as_secs_f64() * 1e6),
            );
        }
    }
    Ok(phases)
}

/// Whether `CUDA_IPC_BENCH_PROBE=1` (read once).
fn probing() -> bool {
    static PROBE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PROBE.get_or_init(|| std::env::var("CUDA_IPC_BENCH_PROBE").as_deref() == Ok("1"))
}

fn mismatch(what: &str, m: &str) -> Error {
    failure(format!("checking {what}"), m)
}

impl State {
    fn sub(&self) -> Result<&Subscriber, Error> {
        self.sub
            .as_ref()
            .ok_or_else(|| failure("the request", "not connected (send connect first)"))
    }

    fn handle(
        &mut self,
        op: &str,
        r: &Value,
        t_recv: u64,
        out: &mut impl std::io::Write,
    ) -> Result<Value, Error> {
        match op {
            "ping" => Ok(json!({ "t_recv": t_recv })),
            "set_attach" => self.set_attach(r, t_recv),
            "set_hold" => {
                let name = text(r, "name")?;
                let set = self.sub()?.attach_set(name)?;
                self.device
                    .stream()
                    .synchronize()
                    .map_err(|e| failure("cuStreamSynchronize", format!("{e:?}")))?;
                let checked = check_set(&set, pattern(r)?);
                if let Err(e) = checked {
                    self.sub()?.release_set(set)?;
                    return Err(e);
                }
                self.sets.insert(name.to_string(), set);
                Ok(json!({ "ok": true }))
            }
            "set_await" => self.set_await(r, t_recv, out),
            "set_drop" => {
                let name = text(r, "name")?;
                let set = self
                    .sets
                    .remove(name)
                    .ok_or_else(|| failure("set_drop", format!("{name:?} is not held")))?;
                self.sub()?.release_set(set)?;
                Ok(json!({ "ok": true }))
            }
            "connect" => self.connect(r),
            "attach" => self.attach(r, t_recv),
            "hold" => self.hold(r),
            "drop" => {
                let name = text(r, "name")?;
                let a = self
                    .held
                    .remove(name)
                    .ok_or_else(|| failure("drop", format!("{name:?} is not held")))?;
                self.sub()?.release(a)?;
                Ok(json!({ "ok": true }))
            }
            "await" => self.wait_update(r, t_recv, out),
            "hold_many" => {
                let prefix = text(r, "prefix")?;
                let count = int(r, "count")?;
                let t = Instant::now();
                for i in 0..count {
                    let name = format!("{prefix}{i}");
                    let a = self.sub()?.attach::<u32>(&name)?;
                    self.held.insert(name, a);
                }
                Ok(json!({ "ms": t.elapsed().as_secs_f64() * 1e3 }))
            }
            "drop_all" => {
                let held: Vec<Attachment<u32>> = self.held.drain().map(|(_, a)| a).collect();
                let sub = self.sub()?;
                for a in held {
                    sub.release(a)?;
                }
                Ok(json!({ "ok": true }))
            }
            "floor_setup" => {
                let handle = text(r, "event")?.parse()?;
                let event = IpcEvent::open(&self.device, handle)?;
                let client =
                    channel::Client::connect(text(r, "socket")?, channel::ClientConfig::default())?;
                let granularity =
                    cuda_ipc::vmm::granularity(&self.device, cuda_ipc::vmm::ShareableTypes::FD)?;
                self.floor = Some(Floor {
                    event,
                    client,
                    granularity,
                });
                Ok(json!({ "ok": true }))
            }
            "floor_legacy" => self.floor_legacy(r),
            "floor_vmm" => self.floor_vmm(r),
            "wake_setup" => self.wake_setup(r),
            "wake_wait" => self.wake_wait(r),
            "bandwidth" => self.bandwidth(r),
            "ring" => self.ring(r, out),
            "sync_ring" => ring::consume_ring(self.sub()?, r, out),
            "respin" => self.respin(r),
            "push_subscribe" => self.push_subscribe(r),
            "push_take" => self.push_take(r, t_recv, out),
            other => Err(failure("the request", format!("unknown op {other:?}"))),
        }
    }

    /// Connects to the publisher at `socket` (waiting on its events or
    /// fences as `sync` says).
    fn connect(&mut self, r: &Value) -> Result<Value, Error> {
        let path = text(r, "socket")?;
        self.socket = Some(path.to_owned());
        let sync = match r.get("sync").and_then(Value::as_str) {
            Some(s) => s.parse()?,
            None => cuda_ipc::exchange::SyncMode::Auto,
        };
        self.sub = Some(Subscriber::connect(
            &self.device,
            std::path::Path::new(path),
            SubscriberConfig::default()
                .with_timeout(Duration::from_secs(60))
                .with_sync(sync),
        )?);
        Ok(json!({ "ok": true }))
    }

    /// Attaches set `name`, synchronises (the clock), checks every buffer
    /// and releases the set.
    fn set_attach(&self, r: &Value, t_recv: u64) -> Result<Value, Error> {
        let name = text(r, "name")?;
        let p = pattern(r)?;
        let sub = self.sub()?;
        let set = sub.attach_set(name)?;
        let phases = crate::proto::phases_json("core.attach_set");
        let synced = self
            .device
            .stream()
            .synchronize()
            .map_err(|e| failure("cuStreamSynchronize", format!("{e:?}")));
        let t_done = mono_ns();
        let checked = Instant::now();
        let bad = synced.and_then(|()| check_set(&set, p));
        let verify_ms = checked.elapsed().as_secs_f64() * 1e3;
        let entries = set.len();
        sub.release_set(set)?;
        bad?;
        Ok(json!({
            "t_recv": t_recv,
            "t_done": t_done,
            "verify_ms": verify_ms,
            "entries": entries,
            "cached_mappings": sub.cached_mappings().0,
            "phases": phases,
        }))
    }

    /// Answers `{waiting}`, waits for the next update of held set `name`,
    /// synchronises (the clock) and checks every buffer.
    fn set_await(
        &self,
        r: &Value,
        t_recv: u64,
        out: &mut impl std::io::Write,
    ) -> Result<Value, Error> {
        let name = text(r, "name")?;
        let p = pattern(r)?;
        let set = self
            .sets
            .get(name)
            .ok_or_else(|| failure("set_await", format!("{name:?} is not held")))?;
        let sub = self.sub()?;
        send_line(out, &json!({ "waiting": true }))?;
        let version = sub.wait_set_update(set, WAIT)?;
        self.device
            .stream()
            .synchronize()
            .map_err(|e| failure("cuStreamSynchronize", format!("{e:?}")))?;
        let t_done = mono_ns();
        let checked = Instant::now();
        check_set(set, p)?;
        Ok(json!({
            "t_recv": t_recv,
            "t_done": t_done,
            "version": version,
            "verify_ms": checked.elapsed().as_secs_f64() * 1e3,
        }))
    }

    fn hold(&mut self, r: &Value) -> Result<Value, Error> {
        let name = text(r, "name")?;
        let sub = self.sub()?;
        let a = sub.attach::<u32>(name)?;
        a.buffer().synchronize()?;
        if let Some(m) = verify(a.buffer(), pattern(r)?)? {
            sub.release(a)?;
            return Err(mismatch(name, &m));
        }
        self.held.insert(name.to_string(), a);
        Ok(json!({ "ok": true }))
    }

    fn wait_update(
        &self,
        r: &Value,
        t_recv: u64,
        out: &mut impl std::io::Write,
    ) -> Result<Value, Error> {
        let name = text(r, "name")?;
        let pattern = pattern(r)?;
        let a = self
            .held
            .get(name)
            .ok_or_else(|| failure("await", format!("{name:?} is not held")))?;
        let sub = self.sub()?;
        send_line(out, &json!({ "waiting": true }))?;
        let version = sub.wait_update(a, WAIT)?;
        let phases = with_synchronize(crate::proto::phases_json("core.wait_update"), a.buffer())?;
        let t_done = mono_ns();
        let checked = Instant::now();
        if let Some(m) = verify(a.buffer(), pattern)? {
            return Err(mismatch(name, &m));
        }
        Ok(json!({
            "t_recv": t_recv,
            "t_done": t_done,
            "version": version,
            "verify_ms": checked.elapsed().as_secs_f64() * 1e3,
            "phases": phases,
        }))
    }

    fn attach(&self, r: &Value, t_recv: u64) -> Result<Value, Error> {
        let name = text(r, "name")?;
        let pattern = pattern(r)?;
        let sub = self.sub()?;
        let a = sub.attach::<u32>(name)?;
        let phases = with_synchronize(crate::proto::phases_json("core.attach"), a.buffer())?;
        let t_done = mono_ns();
        let v = Instant::now();
        let bad = verify(a.buffer(), pattern);
        let verify_ms = v.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        sub.release(a)?;
        let release_ms = t.elapsed().as_secs_f64() * 1e3;
        // The mapping's close, retired by the release, finished before the
        // next request (see `proto::settle_retired`); not in `release_ms`.
        crate::proto::settle_retired();
        if let Some(m) = bad? {
            return Err(mismatch(name, &m));
        }
        Ok(json!({
            "t_recv": t_recv,
            "t_done": t_done,
            "verify_ms": verify_ms,
            "release_ms": release_ms,
            "phases": phases,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_buffers_get_distinct_patterns() {
        let p = Pattern::ramp(7, 1);
        assert_eq!(entry_pattern(p, 0), p);
        assert_ne!(entry_pattern(p, 1), entry_pattern(p, 2));
        assert_eq!(entry_pattern(p, 5).step, 1);
    }

    #[test]
    fn the_pad_parses_whole_numbers_and_names_anything_else() {
        use std::ffi::OsStr;
        assert_eq!(parse_pad(None), Ok(0));
        assert_eq!(parse_pad(Some(OsStr::new(""))), Ok(0));
        assert_eq!(parse_pad(Some(OsStr::new(" 1000 "))), Ok(1000));
        assert_eq!(parse_pad(Some(OsStr::new("1000000"))), Ok(1_000_000));
        for bad in ["1e3", "-1", "lots", "1000001", "99999999999999999999999"] {
            let e = parse_pad(Some(OsStr::new(bad))).unwrap_err();
            assert!(
                e.starts_with("CUDA_IPC_BENCH_PAD=") && e.contains(bad) && e.contains("unset it"),
                "{bad}: {e}"
            );
        }
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStrExt;
            let e = parse_pad(Some(OsStr::from_bytes(b"\xff12"))).unwrap_err();
            assert!(e.contains("\\xFF12"), "{e}");
        }
    }

    #[test]
    fn requests_need_their_fields() {
        let r = json!({"name": "x", "base": 7, "step": 1});
        assert_eq!(text(&r, "name").unwrap(), "x");
        assert_eq!(pattern(&r).unwrap(), Pattern::ramp(7, 1));
        assert!(
            text(&r, "socket")
                .unwrap_err()
                .to_string()
                .contains("\"socket\"")
        );
        assert!(pattern(&json!({"base": 1})).is_err());
    }
}
