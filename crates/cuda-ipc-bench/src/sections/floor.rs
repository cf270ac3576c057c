//! Section 3: the driver floor, the least the driver needs for a hand-off
//! ([`cuda_ipc::floor`]), for the report to say how much the library adds.

use cuda_ipc::channel::{self, ServerConfig};
use cuda_ipc::kernels::{self, Speed};
use cuda_ipc::vmm::VmmBuffer;
use cuda_ipc::{DeviceMemory, Error, IpcEvent, LegacyBuffer, Mechanism};
use serde_json::json;

use crate::namespaces::ConsumerNamespaces;
use crate::proto::{REQUEST_TIMEOUT, Worker, failure, get_f64, get_u64, mono_ns};
use crate::report::{Row, Section, SectionId, human};
use crate::stats::ns_to_ms;
use cuda_ipc::floor;

use super::{Ctx, UNPUBLISH_TIMEOUT, pattern, skipped_rows, tag};

/// What the driver floor needs: an event, its own channel (which only
/// carries file descriptors) and the GPU its consumer runs on.
pub(super) struct FloorRig {
    event: IpcEvent,
    pub(super) server: channel::Server,
    /// The consumer's GPU.
    device: usize,
    /// With the consumer on another GPU, the producer's: the consumer's VMM
    /// mappings grant it access too, as the library's peer imports do.
    owner: Option<usize>,
    /// The namespaces its consumer runs in.
    namespaces: ConsumerNamespaces,
}

impl FloorRig {
    /// A rig whose consumer runs on GPU `device`.
    pub(super) fn new(ctx: &Ctx<'_>, device: usize) -> Result<FloorRig, Error> {
        let event = IpcEvent::new(ctx.device)?;
        let path =
            channel::default_socket_path(&format!("bench-{}-floor-{device}", std::process::id()))?;
        let server = channel::Server::bind(ServerConfig::new(path))?;
        Ok(FloorRig {
            event,
            server,
            device,
            owner: (device != ctx.plan.device).then_some(ctx.plan.device),
            namespaces: ctx.plan.namespaces.clone(),
        })
    }

    /// Starts the floor's consumer: it opens the floor's event once and
    /// connects to the floor's channel.
    pub(super) fn consumer(&self) -> Result<Worker, Error> {
        let mut w = Worker::start(self.device, &self.namespaces, "the driver floor's consumer")?;
        w.request(
            &json!({
                "op": "floor_setup",
                "event": self.event.handle()?.to_string(),
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
        let handle = floor::export_legacy(&buffer, &rig.event, stream)?;
        let t_b = mono_ns();
        let a = worker.request(
            &json!({
                "op": "floor_legacy",
                "handle": handle.to_string(),
                "len": size,
                "base": fill.base,
                "step": fill.step,
            }),
            REQUEST_TIMEOUT,
        )?;
        drop(buffer);
        crate::proto::settle_retired();
        (ns_to_ms(t_a, t_b), a)
    } else {
        let buffer = VmmBuffer::alloc(ctx.device, size as usize)
            .map_err(|e| failure(format!("allocating {}", human(size)), e))?;
        kernels::fill_u32(&buffer, fill, Speed::Full)?;
        buffer.synchronize()?;
        bind()?;
        let t_a = mono_ns();
        let fd = floor::export_vmm(&buffer, &rig.event, stream)?;
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
        crate::proto::settle_retired();
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
pub(super) fn floor_row(
    ctx: &Ctx<'_>,
    worker: &mut Worker,
    rig: &FloorRig,
    m: Mechanism,
    size: u64,
) -> Row {
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
pub(super) fn floor_mechanisms(ctx: &Ctx<'_>) -> Vec<Mechanism> {
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
    let steps = 1 + crate::report::WAKE_ROWS + floors.len() as u64 * ctx.plan.sizes.len() as u64;
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
    let (wake_rows, wake_notes) = super::wake::wake_rows(ctx, &rig.server, &mut worker);
    section.rows.extend(wake_rows);
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
        "wake = the machine's floor for a notice to a waiting process, no GPU work: a record \
         written into a shared-memory ring both processes map (cuda-ipc-shm, as the library's \
         notices), and the reader's wake-up socket written when it sleeps; the clock from \
         just before the write to the reader's return from its wait (CLOCK_MONOTONIC in each \
         process). Before each sample both processes are idle for the time shown (the \
         producer in a sleep, the reader waiting): 'asleep' readers sleep in poll(2), the \
         'spinning' one polls the ring (as a consumer whose config's spin outlasts the wait). write p50 = the producer's write alone. Every notice \
         to a consumer that waits (an update, a ring frame, an attach's answer) pays at least \
         this on this machine."
            .into(),
    ];
    section.notes.extend(wake_notes);
    section
}
