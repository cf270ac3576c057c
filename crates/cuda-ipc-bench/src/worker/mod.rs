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
//! request wakes the consumer with no thread hop; if the producer dies the
//! input ends and the consumer exits.

use std::collections::HashMap;
use std::io::BufRead;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use cuda_ipc::cudarc::driver::sys::CUevent_flags;
use cuda_ipc::exchange::{Attachment, RingFrame, SetAttachment, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{Device, DeviceMemory, Error, IpcEvent, LegacyBuffer};
use cuda_ipc::{channel, floor};
use serde_json::{Value, json};

use super::proto::{failure, mono_ns, send_line};
use super::stats::ns_to_ms;

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
    let mut input = std::io::stdin().lock();
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
    };
    let mut line = String::new();
    loop {
        line.clear();
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
/// pattern of `p` (the views are dropped before this returns).
fn check_set(set: &SetAttachment, p: Pattern) -> Result<(), Error> {
    for j in 0..set.len() {
        let view = set.view::<u32>(j)?;
        if let Some(m) = verify(&view, entry_pattern(p, j))? {
            return Err(mismatch(&format!("buffer {j} of set {:?}", set.name()), &m));
        }
    }
    Ok(())
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
            "connect" => {
                let path = text(r, "socket")?;
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
            "bandwidth" => self.bandwidth(r),
            "ring" => self.ring(r, out),
            "sync_ring" => crate::sections::consume_ring(self.sub()?, r, out),
            other => Err(failure("the request", format!("unknown op {other:?}"))),
        }
    }

    /// Attaches set `name`, synchronises (the clock), checks every buffer
    /// and releases the set.
    fn set_attach(&self, r: &Value, t_recv: u64) -> Result<Value, Error> {
        let name = text(r, "name")?;
        let p = pattern(r)?;
        let sub = self.sub()?;
        let set = sub.attach_set(name)?;
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
        let generation = sub.wait_update(a, WAIT)?;
        a.buffer().synchronize()?;
        let t_done = mono_ns();
        let checked = Instant::now();
        if let Some(m) = verify(a.buffer(), pattern)? {
            return Err(mismatch(name, &m));
        }
        Ok(json!({
            "t_recv": t_recv,
            "t_done": t_done,
            "generation": generation,
            "verify_ms": checked.elapsed().as_secs_f64() * 1e3,
        }))
    }

    fn attach(&self, r: &Value, t_recv: u64) -> Result<Value, Error> {
        let name = text(r, "name")?;
        let pattern = pattern(r)?;
        let sub = self.sub()?;
        let a = sub.attach::<u32>(name)?;
        a.buffer().synchronize()?;
        let t_done = mono_ns();
        let v = Instant::now();
        let bad = verify(a.buffer(), pattern);
        let verify_ms = v.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        sub.release(a)?;
        let release_ms = t.elapsed().as_secs_f64() * 1e3;
        if let Some(m) = bad? {
            return Err(mismatch(name, &m));
        }
        Ok(json!({
            "t_recv": t_recv,
            "t_done": t_done,
            "verify_ms": verify_ms,
            "release_ms": release_ms,
        }))
    }

    fn floor(&self) -> Result<&Floor, Error> {
        self.floor
            .as_ref()
            .ok_or_else(|| failure("the floor", "floor_setup was not sent"))
    }

    fn floor_legacy(&self, r: &Value) -> Result<Value, Error> {
        let f = self.floor()?;
        let handle: cuda_ipc::IpcMemHandle = text(r, "handle")?.parse()?;
        let len = int(r, "len")? as usize;
        let pattern = pattern(r)?;
        bind(&self.device)?;
        let t_c = mono_ns();
        let opened = floor::open_legacy(&self.device, &handle, &f.event)?;
        let t_d = mono_ns();
        let bad = opened.memory(len).and_then(|mem| verify(&mem, pattern));
        bind(&self.device)?;
        let t_e = mono_ns();
        let closed = opened.close();
        let t_f = mono_ns();
        if let Some(m) = bad? {
            return Err(mismatch("the legacy floor's mapping", &m));
        }
        closed?;
        Ok(json!({ "open_ms": ns_to_ms(t_c, t_d), "close_ms": ns_to_ms(t_e, t_f) }))
    }

    fn floor_vmm(&self, r: &Value) -> Result<Value, Error> {
        let f = self.floor()?;
        let name = text(r, "name")?;
        let size = int(r, "size")?;
        let len = int(r, "len")? as usize;
        let pattern = pattern(r)?;
        let a = f.client.attach(name)?;
        let result = (|| {
            let fd = a.fds.first().ok_or_else(|| {
                failure("the vmm floor", "no file descriptor came with the entry")
            })?;
            let mut devices = vec![self.device.ordinal() as i32];
            if r.get("also").is_some() {
                devices.push(int(r, "also")? as i32);
            }
            bind(&self.device)?;
            let t_c = mono_ns();
            let mapped = floor::import_vmm(
                &self.device,
                fd.as_fd(),
                size,
                f.granularity,
                &devices,
                &f.event,
            )?;
            let t_d = mono_ns();
            let bad = mapped.memory(len).and_then(|mem| verify(&mem, pattern));
            bind(&self.device)?;
            let t_e = mono_ns();
            let unmapped = mapped.unmap();
            let t_f = mono_ns();
            if let Some(m) = bad? {
                return Err(mismatch("the vmm floor's mapping", &m));
            }
            unmapped?;
            Ok(json!({ "open_ms": ns_to_ms(t_c, t_d), "close_ms": ns_to_ms(t_e, t_f) }))
        })();
        let lease = a.lease;
        drop(a.fds);
        f.client.release(lease)?;
        result
    }

    /// A buffer of `size` bytes on GPU `ordinal`, with peer access from
    /// this consumer's GPU to it (for cuMemcpyPeer at full speed).
    fn remote(&mut self, ordinal: usize, size: usize) -> Result<&LegacyBuffer, Error> {
        let fits = self
            .remote
            .as_ref()
            .is_some_and(|(d, b)| d.ordinal() == ordinal && b.byte_len() == size);
        if !fits {
            self.remote = None;
            let other = Device::open(ordinal)?;
            self.device.enable_peer_access(&other)?;
            let buffer = LegacyBuffer::alloc(&other, size)?;
            self.remote = Some((other, buffer));
        }
        Ok(&self.remote.as_ref().expect("just made").1)
    }

    fn bandwidth(&mut self, r: &Value) -> Result<Value, Error> {
        let name = text(r, "name")?;
        let warmup = int(r, "warmup")? as usize;
        let reps = int(r, "reps")? as usize;
        let written = pattern(r)?;
        let peer_device = r
            .get("peer_device")
            .map(|_| int(r, "peer_device"))
            .transpose()?;
        let a = self.sub()?.attach::<u32>(name)?;
        let result = self.copies(a.buffer(), written, warmup, reps, peer_device);
        self.sub()?.release(a)?;
        result
    }

    /// Times copies out of `mapped`, local ones, into `mapped` and (with
    /// `peer_device`) cuMemcpyPeer from that GPU, interleaved; checks what
    /// the mapping held first (`written`) and what the copies into it left.
    fn copies(
        &mut self,
        mapped: &impl DeviceMemory,
        written: Pattern,
        warmup: usize,
        reps: usize,
        peer_device: Option<u64>,
    ) -> Result<Value, Error> {
        mapped.synchronize()?;
        let size = mapped.byte_len();
        if self
            .local
            .as_ref()
            .is_none_or(|(s, _)| s.byte_len() != size)
        {
            self.local = None;
            self.local = Some((
                LegacyBuffer::alloc(&self.device, size)?,
                LegacyBuffer::alloc(&self.device, size)?,
            ));
        }
        if let Some(d) = peer_device {
            self.remote(d as usize, size)?;
        }
        let remote = peer_device.and(self.remote.as_ref()).map(|(_, b)| b);
        let (src, dst) = self.local.as_ref().expect("just allocated");
        // What the producer wrote, read through the mapping.
        dst.copy_from_device(mapped)?;
        if let Some(bad) = verify(dst, written)? {
            return Err(mismatch("the data read through the mapping", &bad));
        }
        let back = Pattern::ramp(written.base ^ 0x5A5A_5A5A, written.step.wrapping_add(1));
        kernels::fill_u32(src, back, Speed::Full)?;
        let ctx = self.device.context();
        let stream = self.device.stream();
        let cuda = |what: &str, e: cuda_ipc::cudarc::driver::DriverError| {
            failure(format!("timing copies ({what})"), format!("{e:?}"))
        };
        let start = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda("cuEventCreate", e))?;
        let end = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda("cuEventCreate", e))?;
        let time = |copy: &dyn Fn() -> Result<(), Error>| -> Result<f64, Error> {
            start.record(stream).map_err(|e| cuda("cuEventRecord", e))?;
            copy()?;
            end.record(stream).map_err(|e| cuda("cuEventRecord", e))?;
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| cuda("cuEventElapsedTime", e))?;
            Ok(f64::from(ms))
        };
        let (mut from, mut peer, mut local, mut into) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..warmup + reps {
            // Interleaved, so that drift affects every kind alike.
            let from_ms = time(&|| dst.copy_from_device(mapped))?;
            let peer_ms = match remote {
                Some(remote) => Some(time(&|| dst.copy_from_peer(remote))?),
                None => None,
            };
            let local_ms = time(&|| dst.copy_from_device(src))?;
            let into_ms = time(&|| mapped.copy_from_device(src))?;
            if i >= warmup {
                from.push(from_ms);
                peer.extend(peer_ms);
                local.push(local_ms);
                into.push(into_ms);
            }
        }
        stream
            .synchronize()
            .map_err(|e| cuda("cuStreamSynchronize", e))?;
        // The writes reached the producer's buffer.
        if let Some(bad) = verify(mapped, back)? {
            return Err(mismatch("the data written into the mapping", &bad));
        }
        let mut answer = json!({
            "size": size,
            "from_mapping_ms": from,
            "local_ms": local,
            "into_mapping_ms": into,
            "checked": true,
        });
        if remote.is_some() {
            answer["memcpy_peer_ms"] = peer.into();
        }
        Ok(answer)
    }

    fn ring(&self, r: &Value, out: &mut impl std::io::Write) -> Result<Value, Error> {
        let name = text(r, "name")?;
        let verify_every = int(r, "verify_every")?.max(1);
        let sub = self.sub()?;
        let ring = sub.attach_ring::<u32>(name)?;
        send_line(out, &json!({ "subscribed": true }))?;
        let mut tally = RingTally::new(verify_every);
        let result = (|| -> Result<(), Error> {
            loop {
                let frame = sub.next_frame(&ring, WAIT)?;
                if frame.notice.get("stop").and_then(Value::as_bool) == Some(true) {
                    sub.ack(&ring, frame)?;
                    return Ok(());
                }
                frame.buffer.synchronize()?;
                tally.record(&frame, mono_ns())?;
                sub.ack(&ring, frame)?;
            }
        })();
        let released = sub.release_ring(ring);
        result?;
        released?;
        Ok(tally.answer())
    }
}

/// A ring consumer's account of the frames it took: latencies under load
/// and paced, the load phase's first and last arrival, sequence gaps, and
/// the checks of every `verify_every`-th frame (and every paced one).
pub(crate) struct RingTally {
    verify_every: u64,
    load: Vec<f64>,
    paced: Vec<f64>,
    first_ns: u64,
    last_ns: u64,
    frames: u64,
    checked: u64,
    bad: u64,
    first_bad: Option<String>,
    expected_seq: Option<u64>,
    gaps: u64,
}

impl RingTally {
    pub(crate) fn new(verify_every: u64) -> Self {
        RingTally {
            verify_every: verify_every.max(1),
            load: Vec::new(),
            paced: Vec::new(),
            first_ns: 0,
            last_ns: 0,
            frames: 0,
            checked: 0,
            bad: 0,
            first_bad: None,
            expected_seq: None,
            gaps: 0,
        }
    }

    /// Counts `frame`, synchronised and seen at `t` (CLOCK_MONOTONIC ns).
    pub(crate) fn record(&mut self, frame: &RingFrame<'_, u32>, t: u64) -> Result<(), Error> {
        let is_paced = frame.notice.get("p").and_then(Value::as_u64) == Some(1);
        let t_pub = frame
            .notice
            .get("t")
            .and_then(Value::as_u64)
            .ok_or_else(|| failure("a ring frame", "no time stamp in its notice"))?;
        if self.expected_seq.is_some_and(|s| s != frame.seq) {
            self.gaps += 1;
        }
        self.expected_seq = Some(frame.seq + 1);
        let latency = ns_to_ms(t_pub, t);
        if is_paced {
            self.paced.push(latency);
        } else {
            if self.load.is_empty() {
                self.first_ns = t;
            }
            self.last_ns = t;
            self.load.push(latency);
        }
        self.frames += 1;
        if is_paced || (self.frames - 1).is_multiple_of(self.verify_every) {
            self.checked += 1;
            if let Some(m) = verify(frame.buffer, Pattern::ramp(frame.seq as u32, 1))? {
                self.bad += 1;
                self.first_bad
                    .get_or_insert(format!("frame {}: {m}", frame.seq));
            }
        }
        Ok(())
    }

    /// The answer to the producer.
    pub(crate) fn answer(self) -> Value {
        json!({
            "load_ms": self.load,
            "paced_ms": self.paced,
            "load_frames": self.load.len() as u64,
            "first_ns": self.first_ns,
            "last_ns": self.last_ns,
            "checked": self.checked,
            "bad": self.bad,
            "first_bad": self.first_bad,
            "gaps": self.gaps,
        })
    }
}

/// Makes the device's context current on this thread (for raw driver calls).
fn bind(device: &Device) -> Result<(), Error> {
    device
        .context()
        .bind_to_thread()
        .map_err(|e| failure("cuCtxSetCurrent", format!("{e:?}")))
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
