//! Section 5: the streaming ring, frames per second flat out, then paced
//! frames for unloaded latency.

use std::time::{Duration, Instant};

use cuda_ipc::exchange::RingPublisher;
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{Error, Mechanism};
use serde_json::{Value, json};

use crate::proto::{REQUEST_TIMEOUT, Worker, failure, get_f64s, get_u64, mono_ns};
use crate::report::{Row, Section, SectionId, human};

use super::{Consumer, Ctx};

/// Pause between paced ring frames.
pub(crate) const RING_PACE: Duration = Duration::from_micros(500);
/// Every this many ring frames under load, the consumer checks one.
const RING_VERIFY_EVERY: u64 = 1024;

/// The outcome of one ring run, from the consumer's answer.
pub(super) fn ring_rows(m: Mechanism, size: u64, slots: usize, sent: u64, a: &Value) -> Vec<Row> {
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

/// The producer's side of a ring run once its consumer has subscribed
/// (and `ready` says it may start): frames flat out for the plan's load
/// time, then the paced ones [`RING_PACE`] apart, each filled with a ramp
/// of its sequence number and stamped with its time; then a stop frame,
/// whatever happened. Returns the last sequence number and the consumer's
/// answer; the ring is freed only after that answer, with the consumer's
/// mappings gone.
pub(crate) fn run_frames(
    ctx: &Ctx<'_>,
    w: &mut Worker,
    ring: RingPublisher,
    ready: Result<(), Error>,
) -> Result<(u64, Value), Error> {
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
    let mut produced = ready.and_then(|()| {
        let started = Instant::now();
        while started.elapsed() < ctx.plan.ring_load {
            frame(&mut seq, false)?;
        }
        for _ in 0..ctx.plan.ring_paced {
            std::thread::sleep(RING_PACE);
            frame(&mut seq, true)?;
        }
        Ok(())
    });
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
    drop(ring);
    produced?;
    Ok((seq, answer?))
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
    let (seq, a) = run_frames(ctx, w, ring, Ok(()))?;
    Ok(ring_rows(m, size, slots, seq, &a))
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

#[cfg(test)]
mod tests {
    use super::*;

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
