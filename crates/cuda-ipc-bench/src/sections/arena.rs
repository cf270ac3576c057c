//! Fresh hand-offs from an arena: a new buffer each sample, sub-allocated
//! from an arena whose chunks were exported once, before the clock.

use cuda_ipc::Mechanism;

use crate::Reps;
use crate::report::{Row, Section, SectionId, human};

use super::{Consumer, Ctx};

/// Why the library-side rows are not measured by this build (it starts
/// with [`NOT_IN_BUILD`](crate::report::targets::NOT_IN_BUILD), so their
/// targets still show as not measured).
pub(super) const PENDING: &str = "not measured by this build: the library's arena hand-off \
     (publishing a buffer of an arena over the channel) is not in it yet";

/// A row of fresh hand-offs of `size` bytes from an arena of `m` chunks to
/// consumer `c`.
fn arena_row(_ctx: &Ctx<'_>, _c: &mut Consumer, m: Mechanism, size: u64, _reps: Reps) -> Row {
    Row::new(m.name(), "ms").size(size).skip(PENDING)
}

/// The arena section: one row per mechanism and size up to 1 GiB.
pub fn arena(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Arena);
    let mut c = Consumer::new(ctx, "the arena hand-off's consumer");
    for &m in &ctx.plan.mechanisms {
        let unsupported = ctx.unsupported(m);
        for &size in &ctx.plan.arena_sizes {
            if let Some(why) = unsupported.clone() {
                s.rows.push(Row::new(m.name(), "ms").size(size).skip(why));
                ctx.progress.done();
                continue;
            }
            ctx.progress.step(&format!(
                "fresh hand-off from an arena, {m}, {}",
                human(size)
            ));
            s.rows
                .push(arena_row(ctx, &mut c, m, size, ctx.plan.reps(size)));
            ctx.progress.done();
        }
    }
    s.notes = notes();
    s
}

/// What the section's figures include.
pub(crate) fn notes() -> Vec<String> {
    vec![
        "One way, as the fresh hand-off: the producer's clock just before it publishes a new \
         buffer of an arena to the consumer's after it holds the buffer synchronised. The \
         arena's chunk was created and exported before the first sample (Arena::reserve), and \
         the consumer mapped it on the first sample (a warm-up sample): per sample there is no \
         driver export and no import, only the sub-allocation's offset, one event record and \
         one message."
            .into(),
        "Not included: allocating and filling the buffer (a sub-allocation and a kernel, \
         finished before the clock), the consumer's check of 8 words, the release. Columns: \
         per-buffer p50 = the fresh section's row of the same mechanism and size (a new export \
         every sample); PyTorch p50 = its fresh hand-off of the same size in this run."
            .into(),
        format!(
            "Targets: p50 <= {:.3} ms at every size from 2 MiB to 1 GiB, and PyTorch's fresh \
             hand-off p50 / ours >= {:.0}x.",
            crate::report::targets::ARENA_P50_MS,
            crate::report::targets::ARENA_TORCH_SPEEDUP
        ),
    ]
}

#[cfg(test)]
mod tests {
    #[test]
    fn pending_rows_keep_their_targets() {
        assert!(super::PENDING.starts_with(crate::report::targets::NOT_IN_BUILD));
    }
}
