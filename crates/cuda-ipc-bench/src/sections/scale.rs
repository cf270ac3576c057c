//! The scale section: several consumers at once, and many entries live.

use std::time::Duration;

use cuda_ipc::{Dtype, Error, Mechanism};
use serde_json::json;

use crate::Reps;
use crate::proto::{REQUEST_TIMEOUT, Worker, failure, get_u64};
use crate::report::{Row, Section, SectionId, human};
use crate::stats::{Stats, ns_to_ms, slope};

use super::{Ctx, UNPUBLISH_TIMEOUT, allocate, handoff, pattern, tag};

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
            .map(|i| {
                Worker::spawn(
                    ctx.plan.device,
                    &ctx.plan.namespaces,
                    &format!("consumer {}", i + 1),
                )
            })
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
