//! Section 1: fresh hand-offs, a new buffer published and attached each time.

use cuda_ipc::Mechanism;

use crate::Reps;
use crate::proto::{Worker, get_u64};
use crate::report::{Row, Section, SectionId};
use crate::stats::ns_to_ms;

use super::phase_parts::PhaseParts;
use super::{Consumer, Ctx, handoff, handoff_rows, pattern, tag};

/// A row of fresh hand-offs of `size` with `m` to one consumer.
pub(super) fn fresh_row(
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
    let mut phases = PhaseParts::default();
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
        phases.add_json("attach", &a["phases"]);
    }
    phases.into_row(
        row.samples(reps.warmup, total)
            .part("publish", &publish)
            .part("consumer", &consumer)
            .part("verify", &verify)
            .part("teardown", &teardown),
    )
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
         name to the synchronised mapping; 'attach: request' its round trip over the channel, \
         'attach: open' the import, mapping and event of the descriptor, 'attach: synchronize' \
         the stream's wait. Floor and PyTorch: their sections below."
            .into(),
    ];
    s
}
