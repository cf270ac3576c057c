//! The producer's side of each GPU section. Every section starts its
//! consumer process(es) once, measures row after row, and records a failed
//! row (with the error, naming what failed) instead of stopping; a consumer
//! that died is started again for the next row.

use std::time::{Duration, Instant};

use cuda_ipc::channel::{self, ServerConfig};
use cuda_ipc::device::Capabilities;
use cuda_ipc::exchange::Publisher;
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::vmm::VmmBuffer;
use cuda_ipc::{Device, DeviceMemory, Dtype, Error, IpcEvent, LegacyBuffer, Mechanism};
use serde_json::{Value, json};

use super::floor;
use super::proto::{REQUEST_TIMEOUT, Worker, failure, get_f64, get_f64s, get_u64, mono_ns};
use super::report::{PeerInfo, Row, Section, SectionId, human};
use super::stats::{Stats, gb_per_s, ns_to_ms, slope};
use super::{Plan, Progress, Reps};

/// How long the producer waits for consumers to release a buffer.
const UNPUBLISH_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between paced ring frames.
const RING_PACE: Duration = Duration::from_micros(500);
/// Every this many ring frames under load, the consumer checks one.
const RING_VERIFY_EVERY: u64 = 1024;

/// What every section needs.
pub struct Ctx<'a> {
    pub device: &'a Device,
    pub caps: &'a Capabilities,
    pub plan: &'a Plan,
    pub publisher: &'a Publisher,
    pub progress: &'a Progress,
    /// The second GPU (`--devices A,B`) and its link to the first.
    pub peer: Option<PeerInfo>,
}

impl Ctx<'_> {
    /// Why the device cannot share with `m`, if it cannot.
    fn unsupported(&self, m: Mechanism) -> Option<String> {
        share::check_mechanism(self.caps, m)
            .err()
            .map(|e| e.to_string())
    }

    /// The mechanism for the ring and scale sections: the best the device
    /// supports among those asked for (vmm, then pool, then legacy).
    fn primary(&self) -> Option<Mechanism> {
        Mechanism::ALL
            .into_iter()
            .find(|m| self.plan.mechanisms.contains(m) && self.unsupported(*m).is_none())
    }

    /// The publisher's socket path, for consumers.
    fn socket(&self) -> String {
        self.publisher.path().display().to_string()
    }
}

/// A consumer process that is started again if it died.
struct Consumer {
    worker: Option<Worker>,
    label: String,
    device: usize,
    socket: String,
}

impl Consumer {
    /// A consumer on the producer's GPU.
    fn new(ctx: &Ctx<'_>, label: &str) -> Consumer {
        Consumer::on(ctx, label, ctx.plan.device)
    }

    /// A consumer on GPU `device`.
    fn on(ctx: &Ctx<'_>, label: &str, device: usize) -> Consumer {
        Consumer {
            worker: None,
            label: label.to_string(),
            device,
            socket: ctx.socket(),
        }
    }

    /// The running consumer, connected to the publisher.
    fn get(&mut self) -> Result<&mut Worker, Error> {
        let alive = self.worker.as_mut().is_some_and(Worker::alive);
        if !alive {
            self.worker = None;
            let mut w = Worker::start(self.device, &self.label)?;
            w.request(
                &json!({ "op": "connect", "socket": self.socket }),
                REQUEST_TIMEOUT,
            )?;
            self.worker = Some(w);
        }
        Ok(self.worker.as_mut().expect("started above"))
    }
}

/// The pattern of sample `i` of a measurement tagged `tag`: distinct per
/// sample, so a consumer that reads a stale buffer is caught.
fn pattern(tag: u64, i: usize) -> Pattern {
    Pattern::ramp(
        (i as u32)
            .wrapping_mul(0x9E37_79B9)
            .wrapping_add(tag as u32),
        1,
    )
}

fn tag(m: Mechanism, size: u64) -> u64 {
    (size >> 12) ^ ((m as u64) << 40)
}

fn allocate(ctx: &Ctx<'_>, m: Mechanism, size: u64) -> Result<SharedBuffer, Error> {
    SharedBuffer::alloc(ctx.device, size as usize, Some(m)).map_err(|e| {
        failure(
            format!("allocating {} with the {m} mechanism", human(size)),
            e,
        )
    })
}

/// Allocates, fills and finishes a buffer (none of it timed).
fn filled(ctx: &Ctx<'_>, m: Mechanism, size: u64, p: Pattern) -> Result<SharedBuffer, Error> {
    let b = allocate(ctx, m, size)?;
    kernels::fill_u32(&b, p, Speed::Full)?;
    b.synchronize()?;
    Ok(b)
}

/// One fresh hand-off to every consumer in `workers`.
struct Handoff {
    t0: u64,
    t_pub: u64,
    answers: Vec<Value>,
    teardown_ms: f64,
}

/// A new buffer of `size`, filled with `p` and finished, then timed:
/// published, each consumer told its name, each attaches and synchronises;
/// then (not timed) they check and release it and the producer unpublishes
/// and frees it.
fn handoff(
    ctx: &Ctx<'_>,
    workers: &mut [&mut Worker],
    m: Mechanism,
    size: u64,
    name: &str,
    p: Pattern,
) -> Result<Handoff, Error> {
    let buffer = filled(ctx, m, size, p)?;
    let request = json!({ "op": "attach", "name": name, "base": p.base, "step": p.step });
    let t0 = mono_ns();
    let published = ctx.publisher.publish(name, buffer, Dtype::U32, None)?;
    let t_pub = mono_ns();
    let mut error = None;
    let mut sent = 0;
    for w in workers.iter_mut() {
        match w.send(&request) {
            Ok(()) => sent += 1,
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    let mut answers = Vec::with_capacity(sent);
    for w in workers.iter_mut().take(sent) {
        match w.recv(REQUEST_TIMEOUT) {
            Ok(v) => answers.push(v),
            Err(e) => {
                error.get_or_insert(e);
            }
        }
    }
    let t = Instant::now();
    let unpublished = ctx.publisher.unpublish(name, Some(UNPUBLISH_TIMEOUT));
    drop(published);
    let unpublished = unpublished.map(drop);
    let teardown_ms = t.elapsed().as_secs_f64() * 1e3;
    if let Some(e) = error {
        return Err(e);
    }
    unpublished?;
    Ok(Handoff {
        t0,
        t_pub,
        answers,
        teardown_ms,
    })
}

/// A row of fresh hand-offs of `size` with `m` to one consumer.
fn fresh_row(
    ctx: &Ctx<'_>,
    w: &mut Worker,
    m: Mechanism,
    size: u64,
    reps: Reps,
    prefix: &str,
) -> Row {
    let row = Row::new(m.name(), "ms").size(size);
    let (mut total, mut publish, mut consumer, mut verify, mut teardown) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..reps.total() {
        let name = format!("{prefix}/{m}/{size}/{i}");
        let h = match handoff(
            ctx,
            &mut [&mut *w],
            m,
            size,
            &name,
            pattern(tag(m, size), i),
        ) {
            Ok(h) => h,
            Err(e) => {
                return row
                    .samples(reps.warmup, total)
                    .failed(format!("sample {i}: {e}"));
            }
        };
        let a = &h.answers[0];
        let (Ok(t_recv), Ok(t_done)) = (get_u64(a, "t_recv"), get_u64(a, "t_done")) else {
            return row.failed(format!("sample {i}: a malformed answer {a}"));
        };
        if i < reps.warmup {
            continue;
        }
        total.push(ns_to_ms(h.t0, t_done));
        publish.push(ns_to_ms(h.t0, h.t_pub));
        consumer.push(ns_to_ms(t_recv, t_done));
        verify.push(a["verify_ms"].as_f64().unwrap_or(f64::NAN));
        teardown.push(h.teardown_ms);
    }
    row.samples(reps.warmup, total)
        .part("publish", &publish)
        .part("consumer", &consumer)
        .part("verify", &verify)
        .part("teardown", &teardown)
}

fn skipped_rows(s: &mut Section, ctx: &Ctx<'_>, series: &str, why: &str, per: u64) {
    for size in &ctx.plan.sizes {
        s.rows.push(Row::new(series, "ms").size(*size).skip(why));
    }
    for _ in 0..per {
        ctx.progress.done();
    }
}

/// Why `m` cannot share `size` bytes here, if it cannot.
fn too_large(m: Mechanism, size: u64) -> Option<String> {
    (m == Mechanism::Pool && size > cuda_ipc::pool::MAX_SHARED_ALLOCATION).then(|| {
        format!(
            "pool allocations over {} are refused (importing an 8 GiB one crashed the consumer on driver 580)",
            human(cuda_ipc::pool::MAX_SHARED_ALLOCATION)
        )
    })
}

/// One row per mechanism and size, measured by `measure` with consumer
/// `c` (started again if it died), tagged `variant` where given; skipped
/// rows for what the device or the library cannot share.
fn handoff_rows(
    ctx: &Ctx<'_>,
    s: &mut Section,
    c: &mut Consumer,
    variant: Option<&str>,
    what: &str,
    measure: impl Fn(&mut Worker, Mechanism, u64) -> Row,
) {
    let tagged = |row: Row| match variant {
        Some(v) => row.variant(v),
        None => row,
    };
    for &m in &ctx.plan.mechanisms {
        let unsupported = ctx.unsupported(m);
        for &size in &ctx.plan.sizes {
            let row = Row::new(m.name(), "ms").size(size);
            if let Some(why) = unsupported.clone().or_else(|| too_large(m, size)) {
                s.rows.push(tagged(row.skip(why)));
                ctx.progress.done();
                continue;
            }
            ctx.progress.step(&format!("{what}, {m}, {}", human(size)));
            let row = match c.get() {
                Ok(w) => measure(w, m, size),
                Err(e) => row.failed(e.to_string()),
            };
            s.rows.push(tagged(row));
            ctx.progress.done();
        }
    }
}

/// Section 1: fresh hand-off.
pub fn fresh(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Fresh);
    let mut c = Consumer::new(ctx, "the fresh hand-off's consumer");
    handoff_rows(ctx, &mut s, &mut c, None, "fresh hand-off", |w, m, size| {
        fresh_row(ctx, w, m, size, ctx.plan.reps(size), "fresh")
    });
    s.notes = vec![
        "One way: the producer's clock just before Publisher::publish to the consumer's after \
         Subscriber::attach returned and synchronize() on the attached buffer completed (which \
         includes the stream's wait on the publish event). Included: the export (descriptor, \
         file descriptors, event record), telling the consumer the name (one JSON line over a \
         pipe: see the floor's pipe row), the attach over the Unix socket, the mapping and the \
         event wait."
            .into(),
        "Not included: allocating the buffer and filling it with a kernel (finished before the \
         clock starts), the consumer's check of 8 words, the release and the unpublish. A new \
         buffer every sample, so the consumer's mapping cache never hits."
            .into(),
        "publish = the producer's Publisher::publish; consumer = from the consumer reading the \
         name to the synchronised mapping. Floor and PyTorch: their sections below."
            .into(),
    ];
    s
}

/// One cached hand-off row: the consumer holds the buffer; each sample
/// the producer rewrites it, then updates.
fn cached_row(
    ctx: &Ctx<'_>,
    worker: &mut Worker,
    m: Mechanism,
    size: u64,
    reps: Reps,
    prefix: &str,
) -> Row {
    let row = Row::new(m.name(), "ms").size(size);
    let name = format!("{prefix}/{m}/{size}");
    let seed = tag(m, size) ^ 0x5555;
    let buffer = match filled(ctx, m, size, pattern(seed, 0)) {
        Ok(b) => b,
        Err(e) => return row.failed(e.to_string()),
    };
    let published = match ctx.publisher.publish(&name, buffer, Dtype::U32, None) {
        Ok(b) => b,
        Err(e) => return row.failed(format!("publishing: {e}")),
    };
    let p0 = pattern(seed, 0);
    let mut total = Vec::new();
    let mut update = Vec::new();
    let measured = (|| -> Result<(), Error> {
        worker.request(
            &json!({ "op": "hold", "name": name, "base": p0.base, "step": p0.step }),
            REQUEST_TIMEOUT,
        )?;
        for i in 1..=reps.total() {
            let next = pattern(seed, i);
            kernels::fill_u32(&*published, next, Speed::Full)?;
            published.synchronize()?;
            worker.request(
                &json!({ "op": "await", "name": name, "base": next.base, "step": next.step }),
                REQUEST_TIMEOUT,
            )?;
            let t0 = mono_ns();
            ctx.publisher.update(&name)?;
            let t_upd = mono_ns();
            let answer = worker.recv(REQUEST_TIMEOUT)?;
            let t_done = get_u64(&answer, "t_done")?;
            if i > reps.warmup {
                total.push(ns_to_ms(t0, t_done));
                update.push(ns_to_ms(t0, t_upd));
            }
        }
        worker.request(&json!({ "op": "drop", "name": name }), REQUEST_TIMEOUT)?;
        Ok(())
    })();
    let unpublished = ctx.publisher.unpublish(&name, Some(UNPUBLISH_TIMEOUT));
    drop(published);
    let unpublished = unpublished.map(drop);
    let row = row.samples(reps.warmup, total).part("update", &update);
    match (measured, unpublished) {
        (Err(e), _) => row.failed(e.to_string()),
        (Ok(()), Err(e)) => row.failed(format!("unpublishing: {e}")),
        (Ok(()), Ok(())) => row,
    }
}

/// Section 2: cached hand-off.
pub fn cached(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Cached);
    let mut c = Consumer::new(ctx, "the cached hand-off's consumer");
    handoff_rows(
        ctx,
        &mut s,
        &mut c,
        None,
        "cached hand-off",
        |w, m, size| cached_row(ctx, w, m, size, ctx.plan.reps(size), "cached"),
    );
    s.notes = vec![
        "The consumer holds the buffer attached. Each sample the producer rewrites it with a \
         kernel (finished before the clock starts), then the clock runs from just before \
         Publisher::update to the consumer's Subscriber::wait_update returning and synchronize() \
         on the buffer completing (which includes the stream's wait on the update's event). The \
         consumer is already waiting when the update is sent."
            .into(),
        format!(
            "Target: p50 <= {:.3} ms. PyTorch repeat = the same tensor put on a \
             torch.multiprocessing queue again (the PyTorch anchor).",
            super::report::targets::CACHED_P50_MS
        ),
    ];
    s
}

/// What the driver floor needs: an event, its own channel (which only
/// carries file descriptors) and the GPU its consumer runs on.
struct FloorRig {
    event: IpcEvent,
    server: channel::Server,
    /// The consumer's GPU.
    device: usize,
    /// With the consumer on another GPU, the producer's: the consumer's VMM
    /// mappings grant it access too, as the library's peer imports do.
    owner: Option<usize>,
}

impl FloorRig {
    /// A rig whose consumer runs on GPU `device`.
    fn new(ctx: &Ctx<'_>, device: usize) -> Result<FloorRig, Error> {
        let event = IpcEvent::new(ctx.device)?;
        let path =
            channel::default_socket_path(&format!("bench-{}-floor-{device}", std::process::id()))?;
        let server = channel::Server::bind(ServerConfig::new(path))?;
        Ok(FloorRig {
            event,
            server,
            device,
            owner: (device != ctx.plan.device).then_some(ctx.plan.device),
        })
    }

    /// Starts the floor's consumer: it opens the floor's event once and
    /// connects to the floor's channel.
    fn consumer(&self) -> Result<Worker, Error> {
        let mut w = Worker::start(self.device, "the driver floor's consumer")?;
        w.request(
            &json!({
                "op": "floor_setup",
                "event": self.event.handle()?.to_hex(),
                "socket": self.server.path().display().to_string(),
            }),
            REQUEST_TIMEOUT,
        )?;
        Ok(w)
    }
}

fn floor_sample(
    ctx: &Ctx<'_>,
    worker: &mut Worker,
    rig: &FloorRig,
    m: Mechanism,
    size: u64,
    sample: usize,
) -> Result<(f64, f64, f64), Error> {
    let fill = pattern(tag(m, size) ^ 0xF100, sample);
    let stream = ctx.device.stream();
    let bind = || {
        ctx.device
            .context()
            .bind_to_thread()
            .map_err(|e| failure("cuCtxSetCurrent", format!("{e:?}")))
    };
    let answer = if m == Mechanism::Legacy {
        let buffer = LegacyBuffer::alloc(ctx.device, size as usize)
            .map_err(|e| failure(format!("allocating {}", human(size)), e))?;
        kernels::fill_u32(&buffer, fill, Speed::Full)?;
        buffer.synchronize()?;
        bind()?;
        let t_a = mono_ns();
        let handle = floor::export_legacy(buffer.device_address(), rig.event.cu_event(), stream)?;
        let t_b = mono_ns();
        let a = worker.request(
            &json!({
                "op": "floor_legacy",
                "handle": handle.to_hex(),
                "len": size,
                "base": fill.base,
                "step": fill.step,
            }),
            REQUEST_TIMEOUT,
        )?;
        drop(buffer);
        (ns_to_ms(t_a, t_b), a)
    } else {
        let buffer = VmmBuffer::alloc(ctx.device, size as usize)
            .map_err(|e| failure(format!("allocating {}", human(size)), e))?;
        kernels::fill_u32(&buffer, fill, Speed::Full)?;
        buffer.synchronize()?;
        bind()?;
        let t_a = mono_ns();
        let fd = buffer.export_fd()?;
        floor::record(rig.event.cu_event(), stream)?;
        let t_b = mono_ns();
        let name = format!("floor/{size}/{sample}");
        rig.server.publish(&name, json!({}), vec![fd])?;
        let mut request = json!({
            "op": "floor_vmm",
            "name": name,
            "size": buffer.alloc_size(),
            "len": size,
            "base": fill.base,
            "step": fill.step,
        });
        if let Some(owner) = rig.owner {
            request["also"] = owner.into();
        }
        let a = worker.request(&request, REQUEST_TIMEOUT);
        let gone = rig
            .server
            .unpublish(&name)
            .and_then(|()| rig.server.wait_released(&name, Some(UNPUBLISH_TIMEOUT)));
        drop(buffer);
        let a = a?;
        gone?;
        (ns_to_ms(t_a, t_b), a)
    };
    let (export_ms, a) = answer;
    Ok((export_ms, get_f64(&a, "open_ms")?, get_f64(&a, "close_ms")?))
}

/// One way of a JSON line over the pipe: how every hand-off tells the
/// consumer a name.
fn pipe_row(ctx: &Ctx<'_>, worker: &mut Worker) -> Row {
    ctx.progress.step("driver floor: the pipe");
    let reps = ctx.plan.reps_small;
    let mut pipe = Vec::new();
    let mut row = Row::new("pipe", "ms");
    for i in 0..reps.total() {
        let t0 = mono_ns();
        match worker
            .request(&json!({ "op": "ping" }), REQUEST_TIMEOUT)
            .and_then(|a| get_u64(&a, "t_recv"))
        {
            Ok(t) if i >= reps.warmup => pipe.push(ns_to_ms(t0, t)),
            Ok(_) => {}
            Err(e) => {
                row = row.failed(e.to_string());
                break;
            }
        }
    }
    row.samples(reps.warmup, pipe)
}

/// The floor of mechanism `m` at `size`.
fn floor_row(ctx: &Ctx<'_>, worker: &mut Worker, rig: &FloorRig, m: Mechanism, size: u64) -> Row {
    let reps = ctx.plan.reps(size);
    let (mut total, mut export, mut open, mut close) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut row = Row::new(format!("{m} floor"), "ms").size(size);
    for i in 0..reps.total() {
        if !worker.alive() {
            match rig.consumer() {
                Ok(fresh) => *worker = fresh,
                Err(e) => {
                    row = row.failed(format!("restarting the consumer: {e}"));
                    break;
                }
            }
        }
        match floor_sample(ctx, worker, rig, m, size, i) {
            Ok((export_ms, open_ms, close_ms)) if i >= reps.warmup => {
                total.push(export_ms + open_ms);
                export.push(export_ms);
                open.push(open_ms);
                close.push(close_ms);
            }
            Ok(_) => {}
            Err(e) => {
                row = row.failed(format!("sample {i}: {e}"));
                break;
            }
        }
    }
    row.samples(reps.warmup, total)
        .part("export", &export)
        .part("open", &open)
        .part("close", &close)
}

/// The mechanisms asked for that have a raw driver floor (legacy, vmm).
fn floor_mechanisms(ctx: &Ctx<'_>) -> Vec<Mechanism> {
    ctx.plan
        .mechanisms
        .iter()
        .copied()
        .filter(|m| matches!(m, Mechanism::Legacy | Mechanism::Vmm))
        .collect()
}

/// Section 3: the driver floor.
pub fn floor(ctx: &Ctx<'_>) -> Section {
    let mut section = Section::new(SectionId::Floor);
    let floors = floor_mechanisms(ctx);
    let steps = 1 + floors.len() as u64 * ctx.plan.sizes.len() as u64;
    let rig = match FloorRig::new(ctx, ctx.plan.device) {
        Ok(x) => x,
        Err(e) => {
            section.error = Some(format!("setting up: {e}"));
            (0..steps).for_each(|_| ctx.progress.done());
            return section;
        }
    };
    let mut worker = match rig.consumer() {
        Ok(w) => w,
        Err(e) => {
            section.error = Some(e.to_string());
            (0..steps).for_each(|_| ctx.progress.done());
            return section;
        }
    };

    section.rows.push(pipe_row(ctx, &mut worker));
    ctx.progress.done();
    for &m in &floors {
        let series = format!("{m} floor");
        if let Some(why) = ctx.unsupported(m) {
            skipped_rows(
                &mut section,
                ctx,
                &series,
                &why,
                ctx.plan.sizes.len() as u64,
            );
            continue;
        }
        for &size in &ctx.plan.sizes {
            ctx.progress
                .step(&format!("driver floor, {m}, {}", human(size)));
            section
                .rows
                .push(floor_row(ctx, &mut worker, &rig, m, size));
            ctx.progress.done();
        }
    }
    worker.close();
    section.notes = vec![
        "legacy floor = producer (cuIpcGetMemHandle + cuEventRecord) + consumer \
         (cuIpcOpenMemHandle_v2 with LAZY_ENABLE_PEER_ACCESS + the wait: cuEventQuery, and \
         cuStreamWaitEvent only if the event has not completed, + cuStreamSynchronize), each \
         timed with CLOCK_MONOTONIC in its own process and summed."
            .into(),
        "vmm floor = producer (cuMemExportToShareableHandle, via VmmBuffer::export_fd, + \
         cuEventRecord) + consumer (cuMemImportFromShareableHandle + cuMemAddressReserve + \
         cuMemMap + cuMemRelease + cuMemSetAccess + the same wait + cuStreamSynchronize)."
            .into(),
        "Not in the floor: carrying the handle or file descriptor to the other process (a \
         real hand-off must; the pipe row is one JSON line one way, and file descriptors also \
         need SCM_RIGHTS), closing or unmapping (close p50, shown apart). No hand-off can reach \
         the floor; ours/floor says what the library adds on top of the driver. No raw floor \
         for pool."
            .into(),
    ];
    section
}

/// The copies of section 4 the consumer times, by row variant.
const COPIES: [&str; 3] = ["from_mapping", "local", "into_mapping"];
/// The copies of the peer section: section 4's and cuMemcpyPeer.
const PEER_COPIES: [&str; 4] = ["from_mapping", "memcpy_peer", "local", "into_mapping"];

/// One row per copy in `kinds` for mechanism `m`: a buffer of the
/// bandwidth size is published, and consumer `c` times copies out of its
/// mapping, local copies and copies into the mapping (and, with
/// `peer_of`, cuMemcpyPeer from a buffer of its own on that GPU), checking
/// the data both ways.
fn copy_rows(
    ctx: &Ctx<'_>,
    consumer: &mut Consumer,
    m: Mechanism,
    kinds: &[&str],
    peer_of: Option<usize>,
) -> Vec<Row> {
    let size = ctx.plan.bandwidth_size;
    let reps = ctx.plan.bandwidth_reps;
    let row = |kind: &str| Row::new(m.name(), "GB/s").variant(kind).size(size);
    if let Some(why) = ctx.unsupported(m) {
        return vec![row(kinds[0]).skip(why)];
    }
    let name = format!(
        "{}/{m}",
        if peer_of.is_some() {
            "peer"
        } else {
            "bandwidth"
        }
    );
    let written = pattern(tag(m, size), 0);
    let measured = (|| -> Result<Value, Error> {
        let w = consumer.get()?;
        let buffer = filled(ctx, m, size, written)?;
        let published = ctx.publisher.publish(&name, buffer, Dtype::U32, None)?;
        let mut request = json!({
            "op": "bandwidth", "name": name, "warmup": reps.warmup, "reps": reps.reps,
            "base": written.base, "step": written.step,
        });
        if let Some(d) = peer_of {
            request["peer_device"] = d.into();
        }
        let a = w.request(&request, REQUEST_TIMEOUT);
        let gone = ctx.publisher.unpublish(&name, Some(UNPUBLISH_TIMEOUT));
        drop(published);
        let a = a?;
        gone?;
        Ok(a)
    })();
    match measured {
        Ok(answer) => kinds
            .iter()
            .map(|kind| match get_f64s(&answer, &format!("{kind}_ms")) {
                Ok(ms) => row(kind).samples(
                    reps.warmup,
                    ms.iter().map(|ms| gb_per_s(2 * size, *ms)).collect(),
                ),
                Err(e) => row(kind).failed(e.to_string()),
            })
            .collect(),
        Err(e) => vec![row(kinds[0]).failed(e.to_string())],
    }
}

/// Section 4: bandwidth through a mapping.
pub fn bandwidth(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Bandwidth);
    let size = ctx.plan.bandwidth_size;
    let reps = ctx.plan.bandwidth_reps;
    let mut c = Consumer::new(ctx, "the bandwidth consumer");
    for &m in &ctx.plan.mechanisms {
        ctx.progress
            .step(&format!("bandwidth, {m}, {}", human(size)));
        s.rows.extend(copy_rows(ctx, &mut c, m, &COPIES, None));
        ctx.progress.done();
    }
    s.notes = vec![
        format!(
            "In the consumer: device-to-device copies of {} (cuMemcpyDtoDAsync), each timed by a \
             pair of CUDA events (cuEventElapsedTime); GB/s counts bytes read plus bytes written \
             (2 x {}). {} warm-up and {} kept copies of each kind, interleaved.",
            human(size),
            human(size),
            reps.warmup,
            reps.reps
        ),
        format!(
            "from mapping = mapping -> local buffer; local = local -> local; into mapping = local \
             -> mapping. Target: from/local >= {:.2}.",
            super::report::targets::BANDWIDTH_RATIO
        ),
    ];
    s
}

/// The outcome of one ring run, from the consumer's answer.
fn ring_rows(m: Mechanism, size: u64, slots: usize, sent: u64, a: &Value) -> Vec<Row> {
    let base = |v: &str| {
        Row::new(m.name(), "ms")
            .variant(v)
            .size(size)
            .count(slots as u64)
    };
    let parsed = (|| -> Result<(Vec<f64>, Vec<f64>, f64), Error> {
        let load = get_f64s(a, "load_ms")?;
        let paced = get_f64s(a, "paced_ms")?;
        let (first, last) = (get_u64(a, "first_ns")?, get_u64(a, "last_ns")?);
        let fps = if load.len() > 1 && last > first {
            (load.len() - 1) as f64 / ((last - first) as f64 / 1e9)
        } else {
            f64::NAN
        };
        Ok((load, paced, fps))
    })();
    let (load, paced, fps) = match parsed {
        Ok(x) => x,
        Err(e) => return vec![base("load").failed(e.to_string())],
    };
    let received = (load.len() + paced.len()) as u64;
    let mut load_row = base("load").samples(0, load);
    load_row.value = fps.is_finite().then_some(fps);
    let mut problems = Vec::new();
    if received != sent {
        problems.push(format!("{sent} frames sent, {received} received"));
    }
    if let Some(n) = a["gaps"].as_u64().filter(|n| *n > 0) {
        problems.push(format!("{n} gaps in the frame sequence"));
    }
    if let Some(n) = a["bad"].as_u64().filter(|n| *n > 0) {
        problems.push(format!(
            "{n} of {} checked frames wrong (first: {})",
            a["checked"],
            a["first_bad"].as_str().unwrap_or("?")
        ));
    }
    if !problems.is_empty() {
        load_row = load_row.failed(problems.join("; "));
    }
    vec![load_row, base("paced").samples(0, paced)]
}

fn ring_run(
    ctx: &Ctx<'_>,
    w: &mut Worker,
    m: Mechanism,
    size: u64,
    slots: usize,
) -> Result<Vec<Row>, Error> {
    let name = format!("ring/{m}/{size}");
    let ring = ctx.publisher.ring(&name, slots, size as usize, Some(m))?;
    w.request(
        &json!({ "op": "ring", "name": name, "verify_every": RING_VERIFY_EVERY }),
        REQUEST_TIMEOUT,
    )?;
    if ring.subscribers().is_empty() {
        return Err(failure(
            "the ring",
            "the consumer said it subscribed, but the producer sees no subscriber",
        ));
    }
    let acquire = Some(Duration::from_secs(30));
    let mut seq = 0u64;
    let frame = |seq: &mut u64, paced: bool| -> Result<(), Error> {
        let (slot, buffer) = ring.acquire(acquire)?;
        let t = mono_ns();
        kernels::fill_u32(buffer, Pattern::ramp((*seq + 1) as u32, 1), Speed::Full)?;
        let mut extra = serde_json::Map::new();
        extra.insert("t".into(), t.into());
        extra.insert("p".into(), u64::from(paced).into());
        *seq = ring.publish_with(slot, extra)?;
        Ok(())
    };
    let started = Instant::now();
    let mut produced = (|| -> Result<(), Error> {
        while started.elapsed() < ctx.plan.ring_load {
            frame(&mut seq, false)?;
        }
        for _ in 0..ctx.plan.ring_paced {
            std::thread::sleep(RING_PACE);
            frame(&mut seq, true)?;
        }
        Ok(())
    })();
    // The last frame tells the consumer to stop, whatever happened.
    let stop = ring.acquire(acquire).and_then(|(slot, _)| {
        let mut extra = serde_json::Map::new();
        extra.insert("stop".into(), true.into());
        ring.publish_with(slot, extra)
    });
    if produced.is_ok()
        && let Err(e) = stop
    {
        produced = Err(e);
    }
    let answer = w.recv(REQUEST_TIMEOUT);
    // Only now, with the consumer's mappings gone, may the slots be freed.
    drop(ring);
    produced?;
    let a = answer?;
    Ok(ring_rows(m, size, slots, seq, &a))
}

/// The peer section (`--devices A,B`): fresh hand-offs from the producer
/// on GPU A to a consumer on GPU B, and B's copies out of a peer mapping
/// against cuMemcpyPeer between the same GPUs.
pub fn peer(ctx: &Ctx<'_>) -> Section {
    let floors = floor_mechanisms(ctx);
    let mechanisms = ctx.plan.mechanisms.len() as u64;
    let sizes = ctx.plan.sizes.len() as u64;
    let steps = mechanisms * (2 * sizes + 1) + floors.len() as u64 * sizes;
    let a = ctx.plan.device;
    let skip = |why: String| {
        (0..steps).for_each(|_| ctx.progress.done());
        Section::skipped(SectionId::Peer, why)
    };
    let Some(info) = &ctx.peer else {
        return skip("no second GPU: run with --devices A,B".into());
    };
    let b = info.device.ordinal;
    if !info.access_supported {
        return skip(format!(
            "GPU {b} cannot map GPU {a}'s memory (cuDeviceCanAccessPeer says no; link: {}): \
             buffers cannot be shared between these two GPUs without a copy through the host",
            info.link
        ));
    }
    let mut s = Section::new(SectionId::Peer);
    let mut consumer = Consumer::on(ctx, "the consumer on the second GPU", b);
    handoff_rows(
        ctx,
        &mut s,
        &mut consumer,
        None,
        &format!("GPU {a} -> GPU {b} fresh hand-off"),
        |w, m, size| fresh_row(ctx, w, m, size, ctx.plan.reps(size), "peer-fresh"),
    );
    handoff_rows(
        ctx,
        &mut s,
        &mut consumer,
        Some("cached"),
        &format!("GPU {a} -> GPU {b} cached hand-off"),
        |w, m, size| cached_row(ctx, w, m, size, ctx.plan.reps(size), "peer-cached"),
    );
    peer_floor_rows(ctx, &mut s, &floors, b);
    let size = ctx.plan.bandwidth_size;
    for &m in &ctx.plan.mechanisms {
        ctx.progress
            .step(&format!("GPU {a} -> GPU {b} copies, {m}, {}", human(size)));
        s.rows
            .extend(copy_rows(ctx, &mut consumer, m, &PEER_COPIES, Some(a)));
        ctx.progress.done();
    }
    let reps = ctx.plan.bandwidth_reps;
    s.notes = vec![
        format!(
            "Producer on GPU {a}, consumer on GPU {b} ({}; link {}). Hand-offs as in the fresh \
             hand-off section, the consumer's mapping a peer mapping: legacy handles opened with \
             LAZY_ENABLE_PEER_ACCESS, VMM and pool imports granted access for GPU {b}; the \
             consumer's stream on GPU {b} waits on the publish event recorded on GPU {a}. \
             Cached: as in the cached hand-off section, the update's event recorded on GPU {a} \
             and waited on by GPU {b}'s stream. same GPU = the fresh or cached hand-off \
             section's p50, both ends on GPU {a}.",
            info.device.name, info.link
        ),
        format!(
            "floor = the driver floor section's calls with the consumer on GPU {b} (a VMM mapping \
             granting GPU {b} and GPU {a} access in one cuMemSetAccess, as the library does)."
        ),
        format!(
            "Copies of {} on GPU {b}, each timed by a pair of CUDA events: from peer mapping = \
             the mapping of GPU {a}'s buffer -> a GPU {b} buffer; cuMemcpyPeer = a buffer the \
             consumer allocated on GPU {a} -> the same GPU {b} buffer, with peer access enabled \
             (cuCtxEnablePeerAccess), the driver's own peer copy; local = on GPU {b}; into peer \
             mapping = GPU {b} -> the mapping. GB/s counts bytes read plus written (2 x {}); {} \
             warm-up and {} kept copies of each kind, interleaved. The consumer checks the data \
             read through the mapping, and the producer's buffer after the writes into it.",
            human(size),
            human(size),
            reps.warmup,
            reps.reps
        ),
    ];
    s
}

/// The driver floor with its consumer on GPU `b`, for every floor
/// mechanism and size (a failure to set up fails the first row).
fn peer_floor_rows(ctx: &Ctx<'_>, s: &mut Section, floors: &[Mechanism], b: usize) {
    let rig = FloorRig::new(ctx, b).and_then(|rig| rig.consumer().map(|w| (rig, w)));
    let (rig, mut worker) = match rig {
        Ok(x) => x,
        Err(e) => {
            let mut e = Some(e.to_string());
            for &m in floors {
                for &size in &ctx.plan.sizes {
                    let row = Row::new(format!("{m} floor"), "ms").size(size);
                    s.rows.push(match e.take() {
                        Some(why) => row.failed(format!("setting up: {why}")),
                        None => row.skip("the floor's consumer did not start"),
                    });
                    ctx.progress.done();
                }
            }
            return;
        }
    };
    for &m in floors {
        if let Some(why) = ctx.unsupported(m) {
            let series = format!("{m} floor");
            skipped_rows(s, ctx, &series, &why, ctx.plan.sizes.len() as u64);
            continue;
        }
        for &size in &ctx.plan.sizes {
            ctx.progress.step(&format!(
                "GPU {} -> GPU {b} driver floor, {m}, {}",
                ctx.plan.device,
                human(size)
            ));
            s.rows.push(floor_row(ctx, &mut worker, &rig, m, size));
            ctx.progress.done();
        }
    }
    worker.close();
}

/// Section 5: the streaming ring.
pub fn ring(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Ring);
    let Some(m) = ctx.primary() else {
        (0..ctx.plan.ring.len()).for_each(|_| ctx.progress.done());
        return Section::skipped(SectionId::Ring, "no mechanism asked for is supported here");
    };
    let mut c = Consumer::new(ctx, "the ring's consumer");
    for &(size, slots) in &ctx.plan.ring {
        ctx.progress
            .step(&format!("ring, {m}, {} frames, {slots} slots", human(size)));
        let rows = c
            .get()
            .and_then(|w| ring_run(ctx, w, m, size, slots))
            .unwrap_or_else(|e| {
                vec![
                    Row::new(m.name(), "ms")
                        .variant("load")
                        .size(size)
                        .count(slots as u64)
                        .failed(e.to_string()),
                ]
            });
        s.rows.extend(rows);
        ctx.progress.done();
    }
    s.notes = vec![
        format!(
            "Mechanism {m} (the mechanism only matters when the consumer maps the slots, once). \
             Per frame: the producer acquires a slot, fills it with a kernel and calls \
             RingPublisher::publish_with; the consumer takes it with Subscriber::next_frame, \
             synchronizes and acks (and checks 8 words of every {RING_VERIFY_EVERY}th frame and \
             of every paced one)."
        ),
        format!(
            "frames/s: the consumer's frames over its first-to-last time in the load phase ({:.0} s \
             flat out). Latency: the producer's clock just before the fill to the consumer's \
             after synchronize, so it includes the fill kernel and, under load, waiting behind up \
             to `slots` frames; paced: {} frames sent {} us apart, no queueing.",
            ctx.plan.ring_load.as_secs_f64(),
            ctx.plan.ring_paced,
            RING_PACE.as_micros()
        ),
    ];
    s
}

/// Section 6: several consumers, many live entries.
pub fn scale(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Scale);
    let steps = ctx.plan.consumers.len() as u64 + 1;
    let Some(m) = ctx.primary() else {
        (0..steps).for_each(|_| ctx.progress.done());
        return Section::skipped(SectionId::Scale, "no mechanism asked for is supported here");
    };
    let size = ctx.plan.scale_size;
    let most = ctx.plan.consumers.iter().copied().max().unwrap_or(1);
    ctx.progress
        .step(&format!("scale: starting {most} consumers"));
    // Start every consumer at once: their CUDA start-ups overlap.
    let started = (|| -> Result<Vec<Worker>, Error> {
        let mut workers = (0..most)
            .map(|i| Worker::spawn(ctx.plan.device, &format!("consumer {}", i + 1)))
            .collect::<Result<Vec<_>, _>>()?;
        for w in &mut workers {
            w.wait_ready()?;
            w.request(
                &json!({ "op": "connect", "socket": ctx.socket() }),
                REQUEST_TIMEOUT,
            )?;
        }
        Ok(workers)
    })();
    let mut workers = match started {
        Ok(w) => w,
        Err(e) => {
            s.error = Some(format!("starting {most} consumers: {e}"));
            (0..steps).for_each(|_| ctx.progress.done());
            return s;
        }
    };
    let mut points = Vec::new();
    let mut slowest_points = Vec::new();
    for &k in &ctx.plan.consumers {
        ctx.progress
            .step(&format!("scale: {k} consumer(s), {m}, {}", human(size)));
        let rows = consumers_rows(ctx, &mut workers, m, size, k);
        if let (Some(a), Some(b)) = (rows[0].p50(), rows.get(1).and_then(Row::p50)) {
            points.push((k as f64, a));
            slowest_points.push((k as f64, b));
        }
        s.rows.extend(rows);
        ctx.progress.done();
        if error_stops(&mut workers) {
            break;
        }
    }
    let mut slope_row = Row::new(m.name(), "ms/consumer").variant("slope");
    slope_row.value = slope(&points);
    if let Some(v) = slope(&slowest_points).and_then(|v| Stats::of(&[v])) {
        slope_row.parts.insert("slowest".into(), v);
    }
    if ctx.plan.consumers.len() > 1 {
        s.rows.push(slope_row);
    }

    // Many live entries.
    let n = ctx.plan.live_entries;
    ctx.progress
        .step(&format!("scale: {n} live entries, {m}, {}", human(size)));
    s.rows.push(live_entries(
        ctx,
        &mut workers[0],
        m,
        size,
        n,
        ctx.plan.scale_reps,
    ));
    ctx.progress.done();
    for w in workers {
        w.close();
    }
    s.notes = vec![
        format!(
            "k consumer processes attach the same fresh {} buffer ({m}), told its name in turn; \
             each one's latency as in the fresh hand-off (all = every consumer of every sample; slowest = \
             the last of each sample). Slope: least squares over the p50s against k.",
            human(size)
        ),
        format!(
            "Live entries: {n} other {} buffers published and attached by consumer 1 while the \
             fresh hand-off of one more is timed.",
            human(size)
        ),
    ];
    s
}

/// Fresh hand-offs of one buffer to `k` consumers at once: every
/// consumer's latency, and the slowest of each sample.
fn consumers_rows(
    ctx: &Ctx<'_>,
    workers: &mut [Worker],
    m: Mechanism,
    size: u64,
    k: usize,
) -> Vec<Row> {
    let reps = ctx.plan.scale_reps;
    let mut all = Vec::new();
    let mut slowest = Vec::new();
    let mut error = None;
    for i in 0..reps.total() {
        let name = format!("scale/{k}/{i}");
        let mut ws: Vec<&mut Worker> = workers.iter_mut().take(k).collect();
        let done = handoff(
            ctx,
            &mut ws,
            m,
            size,
            &name,
            pattern(tag(m, size) ^ k as u64, i),
        )
        .and_then(|h| {
            h.answers
                .iter()
                .map(|a| get_u64(a, "t_done").map(|t| ns_to_ms(h.t0, t)))
                .collect::<Result<Vec<f64>, Error>>()
        });
        match done {
            Ok(lat) if i >= reps.warmup => {
                slowest.push(lat.iter().copied().fold(f64::MIN, f64::max));
                all.extend(lat);
            }
            Ok(_) => {}
            Err(e) => {
                error = Some(format!("sample {i}: {e}"));
                break;
            }
        }
    }
    let row = |variant: &str, samples| {
        Row::new(m.name(), "ms")
            .variant(variant)
            .count(k as u64)
            .size(size)
            .samples(reps.warmup, samples)
    };
    let all = row("consumers", all);
    let slowest = row("slowest_consumer", slowest);
    if let Some(e) = error {
        vec![all.failed(e)]
    } else {
        vec![all, slowest]
    }
}

/// Whether any consumer died (the scale section then stops adding consumers).
fn error_stops(workers: &mut [Worker]) -> bool {
    workers.iter_mut().any(|w| !w.alive())
}

fn live_entries(
    ctx: &Ctx<'_>,
    w: &mut Worker,
    m: Mechanism,
    size: u64,
    n: usize,
    reps: Reps,
) -> Row {
    let row = Row::new(m.name(), "ms")
        .variant("live_entries")
        .count(n as u64)
        .size(size);
    let mut published = Vec::with_capacity(n);
    let mut samples = Vec::new();
    let measured = (|| -> Result<(), Error> {
        for i in 0..n {
            let b = allocate(ctx, m, size).map_err(|e| failure(format!("entry {i} of {n}"), e))?;
            published.push(
                ctx.publisher
                    .publish(&format!("live/{i}"), b, Dtype::U32, None)?,
            );
        }
        w.request(
            &json!({ "op": "hold_many", "prefix": "live/", "count": n }),
            Duration::from_secs(600),
        )?;
        for i in 0..reps.total() {
            let h = handoff(
                ctx,
                &mut [&mut *w],
                m,
                size,
                &format!("live-probe/{i}"),
                pattern(tag(m, size) ^ 0x11FE, i),
            )?;
            if i >= reps.warmup {
                samples.push(ns_to_ms(h.t0, get_u64(&h.answers[0], "t_done")?));
            }
        }
        w.request(&json!({ "op": "drop_all" }), Duration::from_secs(600))?;
        Ok(())
    })();
    let mut gone = Ok(());
    for i in 0..published.len() {
        if let Err(e) = ctx
            .publisher
            .unpublish(&format!("live/{i}"), Some(UNPUBLISH_TIMEOUT))
            && gone.is_ok()
        {
            gone = Err(e);
        }
    }
    drop(published);
    let row = row.samples(reps.warmup, samples);
    match (measured, gone) {
        (Err(e), _) => row.failed(e.to_string()),
        (Ok(()), Err(e)) => row.failed(format!("unpublishing: {e}")),
        (Ok(()), Ok(())) => row,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_per_sample_and_measurement() {
        let t = tag(Mechanism::Vmm, 2 << 20);
        assert_ne!(pattern(t, 0), pattern(t, 1));
        assert_ne!(
            tag(Mechanism::Vmm, 2 << 20),
            tag(Mechanism::Legacy, 2 << 20)
        );
        assert_ne!(tag(Mechanism::Vmm, 2 << 20), tag(Mechanism::Vmm, 64 << 20));
        assert_eq!(pattern(t, 3).step, 1);
    }

    #[test]
    fn ring_answers_become_rows() {
        let a = json!({
            "load_ms": [0.1, 0.2, 0.3],
            "paced_ms": [0.05],
            "first_ns": 1_000_000_000u64,
            "last_ns": 1_000_020_000u64,
            "checked": 2, "bad": 0, "gaps": 0,
        });
        let rows = ring_rows(Mechanism::Vmm, 4096, 64, 4, &a);
        assert_eq!(rows.len(), 2);
        assert!(rows[0].error.is_none());
        // 2 intervals in 20 us
        assert!((rows[0].value.unwrap() - 100_000.0).abs() < 1e-6);
        assert_eq!(rows[0].count, Some(64));
        assert_eq!(rows[1].variant.as_deref(), Some("paced"));
        let lost = ring_rows(Mechanism::Vmm, 4096, 64, 9, &a);
        assert!(
            lost[0]
                .error
                .as_ref()
                .unwrap()
                .contains("9 frames sent, 4 received")
        );
        let bad = json!({
            "load_ms": [0.1], "paced_ms": [], "first_ns": 1, "last_ns": 1,
            "checked": 1, "bad": 1, "first_bad": "frame 7: word 0", "gaps": 0,
        });
        let rows = ring_rows(Mechanism::Legacy, 4096, 8, 1, &bad);
        assert!(rows[0].error.as_ref().unwrap().contains("frame 7"));
        assert!(rows[0].value.is_none());
        let broken = ring_rows(Mechanism::Legacy, 4096, 8, 1, &json!({}));
        assert!(broken[0].error.as_ref().unwrap().contains("load_ms"));
    }
}
