//! Weight sets: a model's weights (many fp32 tensors, sizes drawn by
//! [`crate::weights`]) handed off in one call, against PyTorch's list of
//! tensors on a queue and its flattened bucket, and the in-place update of
//! a set already attached.

use crate::report::{Row, Section, SectionId, human};
use crate::torch;
use crate::{Plan, Reps};

use super::Ctx;
use super::arena::PENDING;

/// The set hand-off: the clock from just before the producer publishes the
/// set to the consumer holding every buffer of it synchronised.
fn set_row(_ctx: &Ctx<'_>, count: u64, total: u64, _reps: Reps) -> Row {
    Row::new("ours", "ms")
        .variant("set")
        .count(count)
        .size(total)
        .skip(PENDING)
}

/// The update of a set the consumer holds: new contents, one event for the
/// set; the clock from just before the producer's update to the consumer's
/// wait returning and the set synchronised.
fn update_row(_ctx: &Ctx<'_>, count: u64, total: u64, _reps: Reps) -> Row {
    Row::new("ours", "ms")
        .variant("update")
        .count(count)
        .size(total)
        .skip(PENDING)
}

/// The sets section: ours and its update per set, then PyTorch's list and
/// bucket per set (one run of the script).
pub fn sets(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Sets);
    let reps = ctx.plan.set_reps;
    for &(count, total) in &ctx.plan.sets {
        ctx.progress
            .step(&format!("weight set, {count} tensors / {}", human(total)));
        s.rows.push(set_row(ctx, count, total, reps));
        ctx.progress.done();
        ctx.progress.step(&format!(
            "weight set update, {count} tensors / {}",
            human(total)
        ));
        s.rows.push(update_row(ctx, count, total, reps));
        ctx.progress.done();
    }
    ctx.progress
        .step("PyTorch weight sets (bench/torch_share.py --sets)");
    let (rows, torch_notes, error) = torch::set_rows(ctx.plan);
    s.rows.extend(rows);
    s.error = error.map(|e| format!("PyTorch's weight sets: {e}"));
    ctx.progress.done();
    s.notes = notes(ctx.plan);
    s.notes.extend(torch_notes);
    s
}

/// What the section's figures include.
pub(crate) fn notes(plan: &Plan) -> Vec<String> {
    let mut notes = vec![
        "A weight set: N fp32 tensors totalling the size shown, their sizes drawn from a fixed \
         seed (splitmix64, the rule in weights.rs and bench/torch_share.py; the same list for \
         every contender). The tensors live across samples, as a trainer's parameters do; \
         each sample refills every one with its own value before the clock (not timed), and \
         the consumer checks the first and last value of every tensor after it (not timed)."
            .into(),
        "ours set: the clock from just before the producer publishes the set (its buffers in \
         an arena whose chunks were exported before the first sample) to the consumer holding \
         every buffer synchronised (one attach of the whole set, each chunk mapped once). ours \
         update: the consumer holds the set; the clock from just before the producer's update \
         (new contents, one event for the set) to the consumer's wait returning and the set \
         synchronised."
            .into(),
        "PyTorch list: the clock from just before torch.multiprocessing's Queue.put of the list \
         of tensors to the consumer's after Queue.get returned and its stream synchronised. \
         PyTorch bucket: the clock from just before torch.cat packs the tensors into one (the \
         \"flattened bucket\"), then that one tensor on the queue; the consumer splits it back \
         into views (torch.split) and synchronises. extra = device memory the producer needed \
         beyond the tensors (the bucket's copy; torch.cuda.max_memory_allocated)."
            .into(),
        format!(
            "Targets: {} tensors <= {:.1} ms, PyTorch list / ours >= {:.0}x, PyTorch bucket / \
             ours >= {:.0}x, with no extra device memory; {} tensors <= {:.1} ms; the update \
             <= {:.3} ms.",
            crate::report::targets::SET_LARGE,
            crate::report::targets::SET_LARGE_P50_MS,
            crate::report::targets::SET_LIST_SPEEDUP,
            crate::report::targets::SET_BUCKET_SPEEDUP,
            crate::report::targets::SET_SMALL,
            crate::report::targets::SET_SMALL_P50_MS,
            crate::report::targets::SET_UPDATE_P50_MS,
        ),
    ];
    for &(count, total) in &plan.sets {
        match crate::weights::sizes(count, total) {
            Ok(sizes) => notes.push(format!(
                "The {count}-tensor set: {} in tensors of {} to {}.",
                human(total),
                human(sizes.iter().copied().min().unwrap_or(0)),
                human(sizes.iter().copied().max().unwrap_or(0)),
            )),
            Err(e) => notes.push(format!("The {count}-tensor set: {e}")),
        }
    }
    if plan.quick {
        notes.push(format!(
            "--quick: the sets total {} instead of {} (the targets are set for {}).",
            human(crate::plan::SET_TOTAL_QUICK),
            human(crate::plan::SET_TOTAL),
            human(crate::plan::SET_TOTAL)
        ));
    }
    notes
}
