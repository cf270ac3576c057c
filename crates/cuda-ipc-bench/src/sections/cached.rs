//! Section 2: cached hand-offs, the same buffer updated and awaited again.

use cuda_ipc::kernels::{self, Speed};
use cuda_ipc::{DeviceMemory, Dtype, Error, Mechanism};
use serde_json::json;

use crate::Reps;
use crate::proto::{REQUEST_TIMEOUT, Worker, get_u64, mono_ns};
use crate::report::{Row, Section, SectionId};
use crate::stats::ns_to_ms;

use super::phase_parts::PhaseParts;
use super::{Consumer, Ctx, UNPUBLISH_TIMEOUT, filled, handoff_rows, pattern, tag};

/// One cached hand-off row: the consumer holds the buffer; each sample
/// the producer rewrites it, then updates.
pub(super) fn cached_row(
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
    let mut phases = PhaseParts::default();
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
            let updated = cuda_ipc::phases::last("core.update");
            let answer = worker.recv(REQUEST_TIMEOUT)?;
            let t_done = get_u64(&answer, "t_done")?;
            if i > reps.warmup {
                total.push(ns_to_ms(t0, t_done));
                update.push(ns_to_ms(t0, t_upd));
                phases.add("update", &updated);
                phases.add_json("wait_update", &answer["phases"]);
            }
        }
        worker.request(&json!({ "op": "drop", "name": name }), REQUEST_TIMEOUT)?;
        Ok(())
    })();
    let unpublished = ctx.publisher.unpublish(&name, Some(UNPUBLISH_TIMEOUT));
    drop(published);
    let unpublished = unpublished.map(drop);
    let row = phases.into_row(row.samples(reps.warmup, total).part("update", &update));
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
        "Parts 'update: PHASE': Publisher::update's event record, fence signal and notice; \
         'wait_update: stream_wait' the consumer's stream made to wait on the event (or fence), \
         'wait_update: synchronize' the synchronize() after it."
            .into(),
        format!(
            "Target: p50 <= {:.3} ms. PyTorch repeat = the same tensor put on a \
             torch.multiprocessing queue again (the PyTorch anchor).",
            crate::report::targets::CACHED_P50_MS
        ),
    ];
    s
}
