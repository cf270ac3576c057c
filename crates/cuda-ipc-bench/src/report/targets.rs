//! The targets a run is held to, and the verdict on each from the
//! measurements. Pure data; no GPU.

use serde::{Deserialize, Serialize};

use super::format::{fmt_ms, human};
use super::model::{Report, Row, SectionId, Status};

/// Cached hand-off median, ms.
pub const CACHED_P50_MS: f64 = 0.02;
/// Ours p50 / driver floor p50.
pub const FLOOR_RATIO: f64 = 1.5;
/// Copy out of a mapping / local copy.
pub const BANDWIDTH_RATIO: f64 = 0.98;
/// Copy out of a peer mapping / cuMemcpyPeer between the same GPUs.
pub const PEER_BANDWIDTH_RATIO: f64 = 0.98;
/// Frames per second through a ring of 4 KiB frames.
pub const RING_FPS_4K: f64 = 100_000.0;
/// Frames per second through a ring of 4 KiB frames with fences (sync section).
pub const SYNC_RING_FPS_4K: f64 = 250_000.0;
/// The producer's floor frames/s over the fence ring's (sync section).
pub const SYNC_FLOOR_RATIO: f64 = 1.2;
/// An unloaded (paced) ring frame with fences, p50 ms (sync section).
pub const SYNC_UNLOADED_MS: f64 = 0.02;
/// PyTorch p50 / ours p50 for a fresh 64 MiB hand-off.
pub const TORCH_SPEEDUP_64M: f64 = 4.0;
/// The size of the PyTorch comparison.
pub const TORCH_SIZE: u64 = 64 << 20;
/// Run time, seconds (the limits).
pub const QUICK_SECONDS: f64 = 180.0;
/// Run time of a full run, seconds.
pub const FULL_SECONDS: f64 = 480.0;

/// Whether a target was met.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Met.
    Pass,
    /// Measured and not met.
    Miss,
    /// Nothing to compare (the section failed or was skipped).
    NotMeasured,
}

/// One target checked against the measurements.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TargetCheck {
    /// A stable id, for example "cached/vmm/2MiB".
    pub id: String,
    /// What is compared, in words.
    pub what: String,
    /// The target, for example "<= 0.020 ms".
    pub target: String,
    /// The measured figure.
    pub measured: Option<f64>,
    /// The measured figure as printed, or why there is none.
    pub shown: String,
    /// The verdict.
    pub verdict: Verdict,
}

fn check(
    id: String,
    what: String,
    target: String,
    measured: Option<f64>,
    shown: impl Fn(f64) -> String,
    pass: impl Fn(f64) -> bool,
    missing: &str,
) -> TargetCheck {
    let (shown, verdict) = match measured {
        Some(v) if v.is_finite() => (
            shown(v),
            if pass(v) {
                Verdict::Pass
            } else {
                Verdict::Miss
            },
        ),
        _ => (missing.to_string(), Verdict::NotMeasured),
    };
    TargetCheck {
        id,
        what,
        target,
        measured: measured.filter(|v| v.is_finite()),
        shown,
        verdict,
    }
}

fn ran(r: &Report, id: SectionId) -> bool {
    r.section(id).is_some_and(|s| s.status != Status::Skipped)
}

/// Whether section `id` has a skipped row for `series`.
fn skipped(r: &Report, id: SectionId, series: &str) -> bool {
    r.section(id)
        .into_iter()
        .flat_map(|s| &s.rows)
        .any(|row| row.series == series && row.skipped.is_some())
}

fn cached_targets(r: &Report, out: &mut Vec<TargetCheck>) {
    let Some(s) = r
        .section(SectionId::Cached)
        .filter(|_| ran(r, SectionId::Cached))
    else {
        return;
    };
    for row in s.rows.iter().filter(|row| row.skipped.is_none()) {
        let size = row.size.unwrap_or(0);
        out.push(check(
            format!("cached/{}/{}", row.series, human(size)),
            format!("cached hand-off p50, {} {}", row.series, human(size)),
            format!("<= {CACHED_P50_MS:.3} ms"),
            row.p50().filter(|_| row.error.is_none()),
            |v| format!("{} ms", fmt_ms(v)),
            |v| v <= CACHED_P50_MS,
            "failed",
        ));
    }
}

fn floor_targets(r: &Report, out: &mut Vec<TargetCheck>) {
    if !ran(r, SectionId::Fresh) || !ran(r, SectionId::Floor) {
        return;
    }
    for m in ["legacy", "vmm"] {
        if !r.mechanisms.iter().any(|x| x == m) || skipped(r, SectionId::Fresh, m) {
            continue;
        }
        for &size in &r.sizes {
            let ours = r.p50(SectionId::Fresh, m, None, Some(size));
            let floor = r.p50(SectionId::Floor, &format!("{m} floor"), None, Some(size));
            out.push(check(
                format!("floor/{m}/{}", human(size)),
                format!(
                    "fresh hand-off overhead, {m} {}: ours p50 / floor p50",
                    human(size)
                ),
                format!("<= {FLOOR_RATIO:.1}x"),
                ours.zip(floor).map(|(o, f)| o / f),
                |v| format!("{v:.2}x"),
                |v| v <= FLOOR_RATIO,
                "not measured",
            ));
        }
    }
}

/// One target per mechanism of the copies of section `id`: the p50 GB/s of
/// variant `num` over that of `den`, at least `goal`.
fn copy_targets(
    r: &Report,
    out: &mut Vec<TargetCheck>,
    id: SectionId,
    (num, den): (&str, &str),
    what: &str,
    goal: f64,
) {
    if !ran(r, id) {
        return;
    }
    for m in &r.mechanisms {
        // Copies skipped (the mechanism is not supported) have no target;
        // copies that failed or never ran are "not measured".
        let skipped = r.section(id).is_some_and(|s| {
            s.rows
                .iter()
                .any(|row| &row.series == m && row.unit == "GB/s" && row.skipped.is_some())
        });
        if skipped {
            continue;
        }
        let p50 = |v| r.p50(id, m, Some(v), None);
        out.push(check(
            format!("{}/{m}", id.name()),
            what.replace("{m}", m),
            format!(">= {goal:.2}"),
            p50(num).zip(p50(den)).map(|(a, b)| a / b),
            |v| format!("{v:.3}"),
            |v| v >= goal,
            "not measured",
        ));
    }
}

fn ring_targets(r: &Report, out: &mut Vec<TargetCheck>) {
    let Some(s) = r
        .section(SectionId::Ring)
        .filter(|_| ran(r, SectionId::Ring))
    else {
        return;
    };
    let goal = RING_FPS_4K;
    let rows: Vec<&Row> = s
        .rows
        .iter()
        .filter(|row| row.variant.as_deref() == Some("load") && row.size == Some(4096))
        .collect();
    if rows.is_empty() {
        out.push(check(
            "ring/4KiB".into(),
            "ring frames per second, 4 KiB frames".into(),
            format!(">= {goal:.0}/s"),
            None,
            |v| format!("{v:.0}/s"),
            |v| v >= goal,
            "not measured",
        ));
    }
    for row in rows {
        out.push(check(
            format!("ring/{}/4KiB", row.series),
            format!("ring frames per second, 4 KiB frames, {}", row.series),
            format!(">= {goal:.0}/s"),
            row.value.filter(|_| row.error.is_none()),
            |v| format!("{v:.0}/s"),
            |v| v >= goal,
            "failed",
        ));
    }
}

/// The sync section's targets: for every fence ring row (plain and
/// batched), frames/s and the floor over it; the unloaded frame with fences.
fn sync_targets(r: &Report, out: &mut Vec<TargetCheck>) {
    let Some(s) = r
        .section(SectionId::Sync)
        .filter(|_| ran(r, SectionId::Sync))
    else {
        return;
    };
    let floor = r
        .row(SectionId::Sync, "floor: fill + signal", None, Some(4096))
        .and_then(|row| row.value);
    let fences: Vec<&Row> = s
        .rows
        .iter()
        .filter(|row| {
            (row.series.starts_with("fence") || row.series.starts_with("host-fence"))
                && row.variant.as_deref() == Some("load")
        })
        .collect();
    let plain = Row::new("fence", "ms");
    let rows = if fences.is_empty() {
        vec![&plain]
    } else {
        fences
    };
    for row in rows {
        let fps = row.value.filter(|_| row.error.is_none());
        out.push(check(
            format!("sync/ring/{}/4KiB", row.series),
            format!("ring frames per second, 4 KiB frames, {}", row.series),
            format!(">= {SYNC_RING_FPS_4K:.0}/s"),
            fps,
            |v| format!("{v:.0}/s"),
            |v| v >= SYNC_RING_FPS_4K,
            "not measured",
        ));
        out.push(check(
            format!("sync/floor/{}", row.series),
            format!(
                "ring with {} / the producer's floor (fill + signal): time per frame",
                row.series
            ),
            format!("<= {SYNC_FLOOR_RATIO:.1}x"),
            floor.zip(fps).map(|(f, v)| f / v),
            |v| format!("{v:.2}x"),
            |v| v <= SYNC_FLOOR_RATIO,
            "not measured",
        ));
    }
    for series in ["fence", "host-fence"] {
        let paced = r.p50(SectionId::Sync, series, Some("paced"), Some(4096));
        if series == "host-fence" && paced.is_none() {
            continue;
        }
        out.push(check(
            format!("sync/unloaded/{series}"),
            format!("an unloaded ring frame, {series}, p50"),
            format!("<= {SYNC_UNLOADED_MS:.3} ms"),
            paced,
            |v| format!("{} ms", fmt_ms(v)),
            |v| v <= SYNC_UNLOADED_MS,
            "not measured",
        ));
    }
}

fn torch_targets(r: &Report, out: &mut Vec<TargetCheck>) {
    let size = TORCH_SIZE;
    if !ran(r, SectionId::Fresh) || !r.sizes.contains(&size) {
        return;
    }
    let torch = r.p50(SectionId::Torch, "PyTorch", Some("fresh"), Some(size));
    let why = match r.section(SectionId::Torch).map(|s| s.status) {
        Some(Status::Skipped) | None => "PyTorch skipped",
        _ => "not measured",
    };
    for m in &r.mechanisms {
        if skipped(r, SectionId::Fresh, m) {
            continue;
        }
        let ours = r.p50(SectionId::Fresh, m, None, Some(size));
        out.push(check(
            format!("torch/{m}/64MiB"),
            format!("fresh 64 MiB hand-off, {m}: PyTorch p50 / ours p50"),
            format!(">= {TORCH_SPEEDUP_64M:.0}x"),
            torch.zip(ours).map(|(t, o)| t / o),
            |v| format!("{v:.1}x"),
            |v| v >= TORCH_SPEEDUP_64M,
            why,
        ));
    }
}

/// Every target, checked against `r`.
pub fn evaluate(r: &Report) -> Vec<TargetCheck> {
    let mut out = Vec::new();
    cached_targets(r, &mut out);
    floor_targets(r, &mut out);
    copy_targets(
        r,
        &mut out,
        SectionId::Bandwidth,
        ("from_mapping", "local"),
        "copy out of a {m} mapping / local copy (GB/s)",
        BANDWIDTH_RATIO,
    );
    copy_targets(
        r,
        &mut out,
        SectionId::Peer,
        ("from_mapping", "memcpy_peer"),
        "copy out of a {m} peer mapping / cuMemcpyPeer (GB/s)",
        PEER_BANDWIDTH_RATIO,
    );
    ring_targets(r, &mut out);
    sync_targets(r, &mut out);
    torch_targets(r, &mut out);
    let limit = if r.quick { QUICK_SECONDS } else { FULL_SECONDS };
    out.push(check(
        "runtime".into(),
        format!("run time ({})", if r.quick { "--quick" } else { "full" }),
        format!("<= {limit:.0} s"),
        Some(r.elapsed_s),
        |v| format!("{v:.1} s"),
        |v| v <= limit,
        "",
    ));
    out
}
