//! The targets a run is held to, and the verdict on each from the
//! measurements. Pure data; no GPU.

use super::format::{fmt_ms, human};
use super::model::{Report, Row, SectionId, Status, TargetCheck, Verdict};

pub mod mps;
mod python;
pub use python::*;

/// Cached hand-off median, ms, below [`CACHED_LARGE_FROM`], every
/// mechanism.
pub const CACHED_P50_MS: f64 = 0.008;
/// Cached hand-off median, ms, from [`CACHED_LARGE_FROM`] up.
pub const CACHED_LARGE_P50_MS: f64 = 0.010;
/// The size from which the cached hand-off has the larger target.
pub const CACHED_LARGE_FROM: u64 = 1 << 30;
/// The series of the sync section's floor: the producer's fill and signal
/// alone.
pub const SYNC_FLOOR_SERIES: &str = "floor: fill + signal";
/// The series of the driver floor section's wake-up rows: a notice through
/// shared memory to a process that waits for it, no GPU work.
pub const WAKE_SERIES: &str = "wake";
/// The idle times before a wake-up sample, µs, of the rows whose reader
/// sleeps.
pub const WAKE_IDLE_US: [u64; 3] = [100, 1_000, 10_000];
/// The idle time before a sample of the wake-up row whose reader spins, µs.
pub const SPIN_IDLE_US: u64 = 1_000;
/// The wake-up rows (one progress step each): asleep at each idle time,
/// spinning.
pub const WAKE_ROWS: u64 = WAKE_IDLE_US.len() as u64 + 1;

/// The cached hand-off's target at `size` bytes, ms.
pub fn cached_limit(size: u64) -> f64 {
    if size >= CACHED_LARGE_FROM {
        CACHED_LARGE_P50_MS
    } else {
        CACHED_P50_MS
    }
}
/// Fresh hand-off from an arena, median, ms (2 MiB to 1 GiB).
pub const ARENA_P50_MS: f64 = 0.03;
/// PyTorch's fresh hand-off p50 / ours from an arena, same size.
pub const ARENA_TORCH_SPEEDUP: f64 = 10.0;
/// A block pushed to a sleeping consumer, median, ms, at every size.
pub const PUSH_ASLEEP_P50_MS: f64 = 0.015;
/// The same over the wake-up floor (asleep, 0.1 ms idle).
pub const PUSH_WAKE_RATIO: f64 = 2.0;
/// A block pushed to a spinning consumer, median, ms, at every size.
pub const PUSH_SPINNING_P50_MS: f64 = 0.005;
/// The push section's series.
pub const PUSH_ASLEEP: &str = "push, asleep";
/// See [`PUSH_ASLEEP`].
pub const PUSH_SPINNING: &str = "push, spinning";
/// See [`PUSH_ASLEEP`]: the same blocks pulled (an attach by name).
pub const PULL_ASLEEP: &str = "pull, asleep";
/// The large weight set's tensors.
pub const SET_LARGE: u64 = 1000;
/// Its hand-off median, ms.
pub const SET_LARGE_P50_MS: f64 = 1.0;
/// PyTorch's list of tensors p50 / ours, large set.
pub const SET_LIST_SPEEDUP: f64 = 50.0;
/// PyTorch's flattened bucket p50 / ours, large set.
pub const SET_BUCKET_SPEEDUP: f64 = 6.0;
/// The series of the Python rows.
pub const PY_SERIES: &str = "ours from Python";
/// The variant of the row of a fresh process's first attach of a model
/// (`bench/first_attach.py`).
pub const FIRST_ATTACH: &str = "first attach";
/// The series of safetensors' load of the same model.
pub const SAFETENSORS_SERIES: &str = "safetensors";
/// Its variant.
pub const LOAD_FILE: &str = "load_file";
/// The small weight set's tensors.
pub const SET_SMALL: u64 = 100;
/// Its hand-off median, ms.
pub const SET_SMALL_P50_MS: f64 = 0.5;
/// The update of an attached set, median, ms, at any size.
pub const SET_UPDATE_P50_MS: f64 = 0.02;
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

pub(super) fn check(
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
        let limit = cached_limit(size);
        out.push(check(
            format!("cached/{}/{}", row.series, human(size)),
            format!("cached hand-off p50, {} {}", row.series, human(size)),
            format!("<= {limit:.3} ms"),
            row.p50().filter(|_| row.error.is_none()),
            |v| format!("{} ms", fmt_ms(v)),
            |v| v <= limit,
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

/// What a ring row of 4 KiB frames is held to: a frame rate, and its time
/// per frame over the producer's floor's (fill + signal).
pub(super) struct RingGoals<'a> {
    /// The targets' ids start with it (`sync`, `mps`).
    pub(super) prefix: &'a str,
    /// Where the ring ran, in the targets' text (`""`, `" under MPS"`).
    pub(super) under: &'a str,
    /// Frames per second, at least.
    pub(super) fps: f64,
    /// The floor's frames per second over the ring's, at most.
    pub(super) ratio: f64,
}

impl RingGoals<'_> {
    /// The two targets of `row` against the producer's `floor` (frames per
    /// second); `missing`: why the rate, then the ratio, has no figure.
    pub(super) fn check(
        &self,
        out: &mut Vec<TargetCheck>,
        row: &Row,
        floor: Option<f64>,
        missing: [&str; 2],
    ) {
        let (under, series) = (self.under, &row.series);
        let fps = row.value.filter(|_| row.error.is_none());
        let (goal, ratio) = (self.fps, self.ratio);
        out.push(check(
            format!("{}/ring/{series}/4KiB", self.prefix),
            format!("ring frames per second{under}, 4 KiB frames, {series}"),
            format!(">= {goal:.0}/s"),
            fps,
            |v| format!("{v:.0}/s"),
            |v| v >= goal,
            missing[0],
        ));
        out.push(check(
            format!("{}/floor/{series}", self.prefix),
            format!(
                "ring{under} with {series} / the producer's floor{under} (fill + signal): time per \
                 frame"
            ),
            format!("<= {ratio}x"),
            floor.zip(fps).map(|(f, v)| f / v),
            |v| format!("{v:.2}x"),
            |v| v <= ratio,
            missing[1],
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
        .row(SectionId::Sync, SYNC_FLOOR_SERIES, None, Some(4096))
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
    let goals = RingGoals {
        prefix: "sync",
        under: "",
        fps: SYNC_RING_FPS_4K,
        ratio: SYNC_FLOOR_RATIO,
    };
    for row in rows {
        goals.check(out, row, floor, ["not measured", "not measured"]);
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

/// Why a target that needs PyTorch has no figure.
pub(super) fn torch_missing(r: &Report) -> &'static str {
    match r.section(SectionId::Torch).map(|s| s.status) {
        Some(Status::Skipped) | None => "PyTorch skipped",
        _ => "not measured",
    }
}

/// Why a row has no figure: its failure, its skip, or that it is missing.
pub(super) fn why_missing(row: Option<&Row>) -> &'static str {
    match row {
        Some(r) if r.error.is_some() => "failed",
        Some(r) if r.skipped.is_some() => "not measured (skipped)",
        _ => "not measured",
    }
}

fn arena_targets(r: &Report, out: &mut Vec<TargetCheck>) {
    let Some(s) = r
        .section(SectionId::Arena)
        .filter(|_| ran(r, SectionId::Arena))
    else {
        return;
    };
    for m in &r.mechanisms {
        // A mechanism the device lacks has skipped rows and no targets.
        if skipped(r, SectionId::Fresh, m) || skipped(r, SectionId::Arena, m) {
            continue;
        }
        for row in s.rows.iter().filter(|row| &row.series == m) {
            let size = row.size.unwrap_or(0);
            let ours = row.p50().filter(|_| row.error.is_none());
            let missing = why_missing(Some(row));
            out.push(check(
                format!("arena/{m}/{}", human(size)),
                format!("fresh hand-off from an arena p50, {m} {}", human(size)),
                format!("<= {ARENA_P50_MS:.3} ms"),
                ours,
                |v| format!("{} ms", fmt_ms(v)),
                |v| v <= ARENA_P50_MS,
                missing,
            ));
            let torch = r.p50(SectionId::Torch, "PyTorch", Some("fresh"), Some(size));
            out.push(check(
                format!("arena-torch/{m}/{}", human(size)),
                format!(
                    "fresh {} hand-off, PyTorch p50 / ours from a {m} arena",
                    human(size)
                ),
                format!(">= {ARENA_TORCH_SPEEDUP:.0}x"),
                torch.zip(ours).map(|(t, o)| t / o),
                |v| format!("{v:.1}x"),
                |v| v >= ARENA_TORCH_SPEEDUP,
                if ours.is_none() {
                    missing
                } else {
                    torch_missing(r)
                },
            ));
        }
    }
}

fn set_targets(r: &Report, out: &mut Vec<TargetCheck>) {
    let Some(s) = r
        .section(SectionId::Sets)
        .filter(|_| ran(r, SectionId::Sets))
    else {
        return;
    };
    let find = |series: &str, variant: &str, count: u64| {
        s.rows.iter().find(|row| {
            row.series == series
                && row.variant.as_deref() == Some(variant)
                && row.count == Some(count)
        })
    };
    let p50 = |row: Option<&Row>| row.filter(|x| x.error.is_none()).and_then(Row::p50);
    for (count, limit) in [(SET_SMALL, SET_SMALL_P50_MS), (SET_LARGE, SET_LARGE_P50_MS)] {
        let Some(row) = find("ours", "set", count) else {
            continue;
        };
        let total = row.size.map_or_else(|| "?".into(), human);
        let ours = p50(Some(row));
        out.push(check(
            format!("sets/{count}"),
            format!("weight set hand-off p50, {count} tensors / {total}"),
            format!("<= {limit:.1} ms"),
            ours,
            |v| format!("{} ms", fmt_ms(v)),
            |v| v <= limit,
            why_missing(Some(row)),
        ));
        if count == SET_LARGE {
            for (variant, goal) in [("list", SET_LIST_SPEEDUP), ("bucket", SET_BUCKET_SPEEDUP)] {
                let torch_row = find("PyTorch", variant, count);
                out.push(check(
                    format!("sets-{variant}/{count}"),
                    format!("weight set, {count} tensors: PyTorch {variant} p50 / ours"),
                    format!(">= {goal:.0}x"),
                    p50(torch_row).zip(ours).map(|(t, o)| t / o),
                    |v| format!("{v:.1}x"),
                    |v| v >= goal,
                    if ours.is_none() {
                        why_missing(Some(row))
                    } else if torch_row.is_some_and(|t| t.error.is_some()) {
                        "failed"
                    } else {
                        torch_missing(r)
                    },
                ));
            }
            out.push(check(
                format!("sets-memory/{count}"),
                format!("weight set, {count} tensors: extra device memory of ours"),
                "0 bytes".into(),
                row.extra_device_bytes
                    .filter(|_| ours.is_some())
                    .map(|b| b as f64),
                |v| human(v as u64),
                |v| v <= 0.0,
                why_missing(Some(row)),
            ));
        }
    }
    python::targets(r, s, out);
    for row in s
        .rows
        .iter()
        .filter(|row| row.series == "ours" && row.variant.as_deref() == Some("update"))
    {
        let count = row.count.unwrap_or(0);
        out.push(check(
            format!("sets-update/{count}"),
            format!("weight set update p50, {count} tensors"),
            format!("<= {SET_UPDATE_P50_MS:.3} ms"),
            p50(Some(row)),
            |v| format!("{} ms", fmt_ms(v)),
            |v| v <= SET_UPDATE_P50_MS,
            why_missing(Some(row)),
        ));
    }
}

/// The line under the targets that gives this machine's wake-up floor (the
/// driver floor section's wake rows): what a notice to a waiting process
/// costs here with no GPU work, the least that every update, ring frame
/// and attach's answer to a waiting consumer pays. `None` without them.
pub fn wake_floor_line(r: &Report) -> Option<String> {
    let rows: Vec<String> = r
        .section(SectionId::Floor)?
        .rows
        .iter()
        .filter(|row| row.series == WAKE_SERIES && row.error.is_none())
        .filter_map(|row| {
            Some(format!(
                "{} {} ms",
                row.variant.as_deref()?,
                fmt_ms(row.p50()?)
            ))
        })
        .collect();
    (!rows.is_empty()).then(|| {
        format!(
            "Wake-up floor here (driver floor section, a notice through shared memory, no GPU \
             work), p50: {}. Every update, ring frame and attach's answer to a waiting consumer \
             pays at least one.",
            rows.join("; ")
        )
    })
}

/// The wake-up floor a sleeping consumer pays: the driver floor section's
/// notice to a reader asleep after 0.1 ms idle, p50, ms.
pub fn wake_floor_ms(r: &Report) -> Option<f64> {
    r.section(SectionId::Floor)?
        .rows
        .iter()
        .find(|row| {
            row.series == WAKE_SERIES
                && row.error.is_none()
                && row.variant.as_deref() == Some("asleep, 0.1 ms idle")
        })?
        .p50()
}

/// The p50 limit of a push row of `series` (none for the pull rows):
/// with a sleeping consumer the lower of [`PUSH_ASLEEP_P50_MS`] and
/// [`PUSH_WAKE_RATIO`] times the wake-up floor `floor`.
pub fn push_limit_ms(series: &str, floor: Option<f64>) -> Option<f64> {
    match series {
        PUSH_ASLEEP => Some(floor.map_or(PUSH_ASLEEP_P50_MS, |f| {
            PUSH_ASLEEP_P50_MS.min(PUSH_WAKE_RATIO * f)
        })),
        PUSH_SPINNING => Some(PUSH_SPINNING_P50_MS),
        _ => None,
    }
}

fn push_targets(r: &Report, out: &mut Vec<TargetCheck>) {
    let Some(s) = r
        .section(SectionId::Push)
        .filter(|_| ran(r, SectionId::Push))
    else {
        return;
    };
    let floor = wake_floor_ms(r);
    for row in &s.rows {
        let size = human(row.size.unwrap_or(0));
        let ours = row.p50().filter(|_| row.error.is_none());
        let missing = why_missing(Some(row));
        let (limit, what) = match row.series.as_str() {
            PUSH_ASLEEP => (PUSH_ASLEEP_P50_MS, "a sleeping consumer"),
            PUSH_SPINNING => (PUSH_SPINNING_P50_MS, "a spinning consumer"),
            _ => continue,
        };
        out.push(check(
            format!("push/{}/{size}", row.series),
            format!("fresh push hand-off p50 to {what}, {size}"),
            format!("<= {limit:.3} ms"),
            ours,
            |v| format!("{} ms", fmt_ms(v)),
            |v| v <= limit,
            missing,
        ));
        if row.series == PUSH_ASLEEP {
            out.push(check(
                format!("push-wake/{size}"),
                format!("fresh push hand-off to a sleeping consumer / the wake-up floor, {size}"),
                format!("<= {PUSH_WAKE_RATIO:.0}x"),
                ours.zip(floor).map(|(o, f)| o / f),
                |v| format!("{v:.2}x"),
                |v| v <= PUSH_WAKE_RATIO,
                if floor.is_none() {
                    "no wake-up floor measured"
                } else {
                    missing
                },
            ));
        }
    }
}

/// Every target, checked against `r`.
pub fn evaluate(r: &Report) -> Vec<TargetCheck> {
    let mut out = Vec::new();
    cached_targets(r, &mut out);
    arena_targets(r, &mut out);
    push_targets(r, &mut out);
    set_targets(r, &mut out);
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
    mps::targets(r, &mut out);
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

impl Report {
    /// Checks every target against the measurements and stores the verdicts.
    pub fn evaluate(&mut self) {
        self.targets = evaluate(self);
    }
}
