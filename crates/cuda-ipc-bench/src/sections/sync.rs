//! Section: interprocess events against GPU-side fences, in the same run
//! and on the same device: the cached hand-off (an update of an attached
//! buffer) and a ring of 4 KiB frames, each with one consumer that waits on
//! the publisher's events and one that waits on its fences
//! ([`SyncMode`](cuda_ipc::exchange::SyncMode) forced), next to a floor: the
//! producer's own per-frame work with nobody consuming. Two rows measure
//! what the per-frame switch between the two processes' contexts costs: a
//! consumer that takes frames in batches (several stream waits, one
//! synchronize), and one that waits on the fence from the host only
//! (`SyncMode::HostFence`: no stream operation per frame).

use std::time::Instant;

use cuda_ipc::event::IpcEvent;
use cuda_ipc::exchange::RingSync;
use cuda_ipc::fence::Fence;
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{DeviceMemory, Error, Mechanism};
use serde_json::{Value, json};

use crate::namespaces::ConsumerNamespaces;
use crate::proto::{REQUEST_TIMEOUT, Worker, failure};
use crate::report::{Row, Section, SectionId, human};

use crate::plan::{MODES, RING_RUNS, SYNC_BATCH, SYNC_STEPS};

use super::cached::cached_row;
use super::ring::{RING_PACE, ring_rows, run_frames};
use super::{Ctx, allocate};

/// The ring's frame size.
pub const SYNC_FRAME: u64 = 4096;
/// The ring's slots.
const SLOTS: usize = 64;
/// Every this many frames under load, the consumer checks one.
const VERIFY_EVERY: u64 = 1024;
/// The series of a row: the sync mode, with the batch when it is not 1.
pub(crate) fn series(mode: &str, batch: u64) -> String {
    if batch > 1 {
        format!("{mode}, batch {batch}")
    } else {
        mode.to_string()
    }
}

/// The floor's series.
pub(crate) const FLOOR_SERIES: &str = crate::report::targets::SYNC_FLOOR_SERIES;
/// The floor with the producer's whole per-frame GPU work.
pub(crate) const FLOOR_ALL_SERIES: &str = "floor: fill + record + signal";

/// A consumer process connected with a sync mode, started again if it died.
struct SyncConsumer {
    worker: Option<Worker>,
    mode: &'static str,
    device: usize,
    socket: String,
    namespaces: ConsumerNamespaces,
}

impl SyncConsumer {
    fn get(&mut self) -> Result<&mut Worker, Error> {
        let alive = self.worker.as_mut().is_some_and(Worker::alive);
        if !alive {
            self.worker = None;
            let label = format!("the sync section's {} consumer", self.mode);
            let mut w = Worker::start(self.device, &self.namespaces, &label)?;
            w.request(
                &json!({ "op": "connect", "socket": self.socket, "sync": self.mode }),
                REQUEST_TIMEOUT,
            )?;
            self.worker = Some(w);
        }
        Ok(self.worker.as_mut().expect("started above"))
    }
}

/// Whether the consumer's answer at subscribing says it waits the way
/// `mode` asks; an error that says otherwise.
pub(crate) fn check_mode(mode: &str, subscribed: &Value) -> Result<(), Error> {
    let fence = subscribed["fence"].as_bool().ok_or_else(|| {
        failure(
            "the ring's consumer",
            "its answer does not say whether it waits on fences",
        )
    })?;
    if fence == (mode != "event") {
        Ok(())
    } else {
        Err(failure(
            "the ring's consumer",
            format!(
                "asked to wait on {mode}s, it waits on {}",
                if fence { "fences" } else { "events" }
            ),
        ))
    }
}

/// Rows of a ring answer, named for the sync mode and batch.
pub(crate) fn named_rows(
    m: Mechanism,
    mode: &str,
    batch: u64,
    sent: u64,
    answer: &Value,
) -> Vec<Row> {
    let mut rows = ring_rows(m, SYNC_FRAME, SLOTS, sent, answer);
    for row in &mut rows {
        row.series = series(mode, batch);
    }
    rows
}

/// One ring run: flat out for the plan's load time, then paced frames.
fn ring_run(
    ctx: &Ctx<'_>,
    w: &mut Worker,
    m: Mechanism,
    mode: &str,
    batch: u64,
) -> Result<Vec<Row>, Error> {
    let name = format!("sync-ring/{mode}/{batch}");
    // Readers of fences get a ring that records no event per frame, as the
    // floor (fill + signal) they are held against.
    let sync = if mode == "event" {
        RingSync::EventsAndFences
    } else {
        RingSync::FencesOnly
    };
    let ring = ctx
        .publisher
        .ring_with(&name, SLOTS, SYNC_FRAME as usize, Some(m), sync)?;
    let subscribed = w.request(
        &json!({ "op": "sync_ring", "name": name, "batch": batch, "verify_every": VERIFY_EVERY }),
        REQUEST_TIMEOUT,
    )?;
    let (seq, answer) = run_frames(ctx, w, ring, check_mode(mode, &subscribed))?;
    Ok(named_rows(m, mode, batch, seq, &answer))
}

/// Frames per second from `frames` over `seconds`.
pub(crate) fn rate(frames: u64, seconds: f64) -> Option<f64> {
    (frames > 0 && seconds > 0.0).then(|| frames as f64 / seconds)
}

/// The floor: the producer's per-frame work on a 4 KiB buffer with nobody
/// consuming, flat out for the plan's load time: a fill launch and a fence
/// signal (and, with `record`, the event record every frame also does).
fn floor_row(ctx: &Ctx<'_>, m: Mechanism, record: bool) -> Row {
    let series = if record {
        FLOOR_ALL_SERIES
    } else {
        FLOOR_SERIES
    };
    let row = Row::new(series, "ms").size(SYNC_FRAME);
    let measured = (|| -> Result<Option<f64>, Error> {
        let buffer = allocate(ctx, m, SYNC_FRAME)?;
        let fence = Fence::new_host(ctx.device, 1)?;
        let event = IpcEvent::new(ctx.device)?;
        let stream = buffer.stream().clone();
        let mut n = 0u64;
        let started = Instant::now();
        while started.elapsed() < ctx.plan.ring_load {
            n += 1;
            kernels::fill_u32(&buffer, Pattern::ramp(n as u32, 1), Speed::Full)?;
            if record {
                event.record(&stream)?;
            }
            fence.signal(&stream, 0, n)?;
        }
        buffer.synchronize()?;
        Ok(rate(n, started.elapsed().as_secs_f64()))
    })();
    match measured {
        Ok(fps) => {
            let mut row = row;
            row.value = fps;
            row
        }
        Err(e) => row.failed(e.to_string()),
    }
}

/// The section.
pub fn sync(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Sync);
    let Some(m) = ctx.primary() else {
        (0..SYNC_STEPS).for_each(|_| ctx.progress.done());
        return Section::skipped(SectionId::Sync, "no mechanism asked for is supported here");
    };
    let mut consumers = MODES.map(|mode| SyncConsumer {
        worker: None,
        mode,
        device: ctx.plan.device,
        socket: ctx.socket(),
        namespaces: ctx.plan.namespaces.clone(),
    });
    let size = ctx.plan.sizes[0];
    for c in &mut consumers {
        ctx.progress
            .step(&format!("sync, cached hand-off, {}s", c.mode));
        let row = match c.get() {
            Ok(w) => cached_row(ctx, w, m, size, ctx.plan.reps(size), "sync-cached"),
            Err(e) => Row::new(m.name(), "ms").size(size).failed(e.to_string()),
        };
        let mut row = row.variant("cached");
        row.series = c.mode.to_string();
        s.rows.push(row);
        ctx.progress.done();
    }
    for (mode, batch) in RING_RUNS {
        ctx.progress.step(&format!(
            "sync, ring, {} frames, {}",
            human(SYNC_FRAME),
            series(mode, batch)
        ));
        let c = consumers
            .iter_mut()
            .find(|c| c.mode == mode)
            .expect("a consumer per mode");
        let rows = c
            .get()
            .and_then(|w| ring_run(ctx, w, m, mode, batch))
            .unwrap_or_else(|e| {
                vec![
                    Row::new(series(mode, batch), "ms")
                        .variant("load")
                        .size(SYNC_FRAME)
                        .count(SLOTS as u64)
                        .failed(e.to_string()),
                ]
            });
        s.rows.extend(rows);
        ctx.progress.done();
    }
    for record in [false, true] {
        ctx.progress.step("sync, the producer's floor");
        s.rows.push(floor_row(ctx, m, record));
        ctx.progress.done();
    }
    for c in consumers {
        if let Some(w) = c.worker {
            w.close();
        }
    }
    s.notes = vec![
        format!(
            "Mechanism {m}. Three consumers: one waits on the publisher's interprocess events, \
             one on its GPU-side fences, one on the fences from the host only (SyncMode forced: \
             event, fence, host-fence), on the same device in the same run. \
             Rows 'cached': Publisher::update to the consumer's wait_update and synchronize \
             ({}), p50 in the 'load p50' column.",
            human(size)
        ),
        format!(
            "Ring rows: {} frames, {SLOTS} slots, as in the ring section (frames/s over {:.0} s \
             flat out, then {} paced frames {} us apart). 'batch {SYNC_BATCH}': the consumer \
             takes up to {SYNC_BATCH} frames, synchronizes once, then acks them, so its context \
             runs once per batch instead of once per frame. 'host-fence': the consumer waits \
             on the fence word from the host and queues no stream wait, so its context runs \
             nothing per frame (its own work on a frame would still be time-sliced with the \
             producer's). The fence and host-fence rows' rings are fences-only \
             (RingSync::FencesOnly: each frame signals its slot's fence and records no event); \
             the event rows' record the event and signal the fence.",
            human(SYNC_FRAME),
            ctx.plan.ring_load.as_secs_f64(),
            ctx.plan.ring_paced,
            RING_PACE.as_micros()
        ),
        "Floors: the producer alone on a 4 KiB buffer (frames/s): a fill launch and a fence \
         signal per frame; and with the event record every frame also does. Nobody consumes."
            .into(),
        format!(
            "Targets: ring with fences >= {:.0} frames/s and <= {:.1}x the floor (fill + \
             signal); an unloaded (paced) frame with fences p50 <= {:.3} ms.",
            crate::report::targets::SYNC_RING_FPS_4K,
            crate::report::targets::SYNC_FLOOR_RATIO,
            crate::report::targets::SYNC_UNLOADED_MS
        ),
    ];
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_name_the_mode_and_batch() {
        assert_eq!(series("fence", 1), "fence");
        assert_eq!(series("event", 8), "event, batch 8");
        assert_eq!(SYNC_STEPS, 10);
    }

    #[test]
    fn the_consumer_must_wait_as_asked() {
        check_mode("fence", &json!({ "fence": true })).unwrap();
        check_mode("event", &json!({ "fence": false })).unwrap();
        check_mode("host-fence", &json!({ "fence": true })).unwrap();
        let e = check_mode("fence", &json!({ "fence": false })).unwrap_err();
        assert!(e.to_string().contains("it waits on events"), "{e}");
        let e = check_mode("event", &json!({ "subscribed": true })).unwrap_err();
        assert!(e.to_string().contains("does not say"), "{e}");
    }

    #[test]
    fn ring_answers_become_rows_named_for_the_mode() {
        let a = json!({
            "load_ms": [0.1, 0.2, 0.3],
            "paced_ms": [0.05],
            "first_ns": 1_000_000_000u64,
            "last_ns": 1_000_020_000u64,
            "checked": 2, "bad": 0, "gaps": 0,
        });
        let rows = named_rows(Mechanism::Vmm, "fence", SYNC_BATCH, 4, &a);
        assert_eq!(rows.len(), 2);
        assert!(rows.iter().all(|r| r.series == "fence, batch 8"));
        assert_eq!(rows[0].variant.as_deref(), Some("load"));
        assert!((rows[0].value.unwrap() - 100_000.0).abs() < 1e-6);
        assert_eq!(rows[1].variant.as_deref(), Some("paced"));
        assert_eq!(rows[0].size, Some(SYNC_FRAME));
    }

    #[test]
    fn rates_need_frames_and_time() {
        assert_eq!(rate(232_000, 1.0), Some(232_000.0));
        assert_eq!(rate(0, 1.0), None);
        assert_eq!(rate(5, 0.0), None);
    }
}
