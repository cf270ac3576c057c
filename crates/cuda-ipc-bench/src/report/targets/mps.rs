//! The targets of a `--mps` run's pass under MPS (issue 25): the ring of
//! 4 KiB frames under MPS against a fixed rate and against the producer's
//! own floor (fill + signal) under MPS, measured in the same pass.

use super::super::model::{Report, Row, Section, SectionId, Status, TargetCheck};
use super::{RingGoals, SYNC_FLOOR_SERIES};

/// Frames per second through a ring of 4 KiB frames under MPS.
pub const MPS_RING_FPS_4K: f64 = 150_000.0;
/// The ring's time per frame under MPS over the producer's floor's (fill
/// + signal) under MPS.
pub const MPS_FLOOR_RATIO: f64 = 1.25;

/// The pass under MPS of section `id`, when it ran.
fn under_mps(r: &Report, id: SectionId) -> Option<&Section> {
    r.sections
        .iter()
        .find(|s| s.id == id && s.mps && s.status != Status::Skipped)
}

/// The targets of the pass under MPS; none when the run had no such pass.
pub(super) fn targets(r: &Report, out: &mut Vec<TargetCheck>) {
    let Some(ring) = under_mps(r, SectionId::Ring) else {
        return;
    };
    let floor = under_mps(r, SectionId::Sync)
        .and_then(|s| {
            s.rows.iter().find(|row| {
                row.series == SYNC_FLOOR_SERIES && row.size == Some(4096) && row.error.is_none()
            })
        })
        .and_then(|row| row.value);
    let rows: Vec<&Row> = ring
        .rows
        .iter()
        .filter(|row| row.variant.as_deref() == Some("load") && row.size == Some(4096))
        .collect();
    let goals = RingGoals {
        prefix: "mps",
        under: " under MPS",
        fps: MPS_RING_FPS_4K,
        ratio: MPS_FLOOR_RATIO,
    };
    for row in rows {
        let failed = if row.error.is_some() {
            "failed"
        } else {
            "not measured"
        };
        let ratio_missing = if row.value.is_some() && row.error.is_none() {
            "not measured (no floor under MPS)"
        } else {
            failed
        };
        goals.check(out, row, floor, [failed, ratio_missing]);
    }
}
