//! What a bench run found: sections of rows with raw samples and
//! summaries, the targets checked against them, the text table and the
//! JSON document. Pure data and formatting; no GPU.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::stats::Stats;

/// The sections of a run, in the order they run and print.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SectionId {
    /// A new buffer each time: publish to a synchronised mapping.
    Fresh,
    /// An attached buffer with new contents: update to synchronised.
    Cached,
    /// The raw driver calls alone.
    Floor,
    /// Device-to-device copies through a mapping.
    Bandwidth,
    /// Hand-offs and copies from one GPU to another (`--devices A,B`).
    Peer,
    /// Frames through a ring.
    Ring,
    /// Several consumers, many live entries.
    Scale,
    /// torch.multiprocessing's hand-off.
    Torch,
}

impl SectionId {
    /// Every section, in order.
    pub const ALL: [SectionId; 8] = [
        SectionId::Fresh,
        SectionId::Cached,
        SectionId::Floor,
        SectionId::Bandwidth,
        SectionId::Peer,
        SectionId::Ring,
        SectionId::Scale,
        SectionId::Torch,
    ];

    /// The name used on the command line (`--only`) and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            SectionId::Fresh => "fresh",
            SectionId::Cached => "cached",
            SectionId::Floor => "floor",
            SectionId::Bandwidth => "bandwidth",
            SectionId::Peer => "peer",
            SectionId::Ring => "ring",
            SectionId::Scale => "scale",
            SectionId::Torch => "torch",
        }
    }

    /// The heading in the table.
    pub fn title(self) -> &'static str {
        match self {
            SectionId::Fresh => "Fresh hand-off",
            SectionId::Cached => "Cached hand-off",
            SectionId::Floor => "Driver floor",
            SectionId::Bandwidth => "Bandwidth through a mapping",
            SectionId::Peer => "Across two GPUs",
            SectionId::Ring => "Streaming ring",
            SectionId::Scale => "Scale",
            SectionId::Torch => "PyTorch anchor",
        }
    }

    /// Parses a section name.
    pub fn parse(s: &str) -> Result<SectionId, String> {
        SectionId::ALL
            .into_iter()
            .find(|id| id.name() == s)
            .ok_or_else(|| {
                format!(
                    "{s:?} is not a section; choose from {}",
                    SectionId::ALL.map(SectionId::name).join(", ")
                )
            })
    }
}

/// One measured quantity: a series (a mechanism, "PyTorch", a floor) at a
/// size or count, with its raw samples and their summary.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// The mechanism, or "PyTorch", "legacy floor", "vmm floor", "pipe".
    pub series: String,
    /// What was measured within the series: "from_mapping", "local",
    /// "into_mapping" (bandwidth), "load", "paced" (ring), "consumers",
    /// "slowest_consumer", "live_entries", "slope" (scale), "fresh",
    /// "repeat" (PyTorch).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub variant: Option<String>,
    /// The buffer or frame size in bytes.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub size: Option<u64>,
    /// Consumers, live entries or ring slots.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub count: Option<u64>,
    /// The unit of the samples: "ms" or "GB/s".
    pub unit: String,
    /// Samples run first and thrown away.
    pub warmup: usize,
    /// Every kept sample, in the order taken.
    pub samples: Vec<f64>,
    /// Their summary.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub stats: Option<Stats>,
    /// Summaries of the parts of each sample (same unit), by name.
    #[serde(skip_serializing_if = "BTreeMap::is_empty", default)]
    pub parts: BTreeMap<String, Stats>,
    /// A single figure: frames per second for a ring, ms per extra
    /// consumer for a slope.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub value: Option<f64>,
    /// Why this row failed (the section then failed).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
    /// Why this row was not measured (not a failure).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub skipped: Option<String>,
}

impl Row {
    /// A row of samples in `unit`.
    pub fn new(series: impl Into<String>, unit: &str) -> Row {
        Row {
            series: series.into(),
            unit: unit.into(),
            ..Row::default()
        }
    }

    /// Sets the variant.
    #[must_use]
    pub fn variant(mut self, v: impl Into<String>) -> Row {
        self.variant = Some(v.into());
        self
    }

    /// Sets the size.
    #[must_use]
    pub fn size(mut self, size: u64) -> Row {
        self.size = Some(size);
        self
    }

    /// Sets the count.
    #[must_use]
    pub fn count(mut self, count: u64) -> Row {
        self.count = Some(count);
        self
    }

    /// Stores the samples and their summary.
    #[must_use]
    pub fn samples(mut self, warmup: usize, samples: Vec<f64>) -> Row {
        self.warmup = warmup;
        self.stats = Stats::of(&samples);
        self.samples = samples;
        self
    }

    /// Adds the summary of a part.
    #[must_use]
    pub fn part(mut self, name: &str, samples: &[f64]) -> Row {
        if let Some(s) = Stats::of(samples) {
            self.parts.insert(name.into(), s);
        }
        self
    }

    /// Marks the row failed.
    #[must_use]
    pub fn failed(mut self, error: impl Into<String>) -> Row {
        self.error = Some(error.into());
        self
    }

    /// Marks the row skipped.
    #[must_use]
    pub fn skip(mut self, why: impl Into<String>) -> Row {
        self.skipped = Some(why.into());
        self
    }

    /// The median, if measured.
    pub fn p50(&self) -> Option<f64> {
        self.stats.map(|s| s.p50)
    }

    fn part_p50(&self, name: &str) -> Option<f64> {
        self.parts.get(name).map(|s| s.p50)
    }
}

/// How a section ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Every row was measured (or skipped for a reason).
    Ok,
    /// The section or some of its rows failed ([`Section::reason`] says why).
    Failed,
    /// The section did not run ([`Section::reason`] says why).
    Skipped,
}

/// One section of the report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Section {
    /// Which section.
    pub id: SectionId,
    /// How it ended (set by [`Section::finish`]).
    pub status: Status,
    /// Why it failed (its first error) or was skipped.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub reason: Option<String>,
    /// What it measured.
    pub rows: Vec<Row>,
    /// Lines printed under the section (what is included, versions).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub notes: Vec<String>,
    /// An error that stopped the section as a whole (rows carry their own).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
    /// How long the section took, in seconds.
    pub seconds: f64,
}

impl Section {
    /// An empty section.
    pub fn new(id: SectionId) -> Section {
        Section {
            id,
            status: Status::Ok,
            reason: None,
            rows: Vec::new(),
            notes: Vec::new(),
            error: None,
            seconds: 0.0,
        }
    }

    /// A section that did not run.
    pub fn skipped(id: SectionId, reason: impl Into<String>) -> Section {
        Section {
            status: Status::Skipped,
            reason: Some(reason.into()),
            ..Section::new(id)
        }
    }

    /// Sets the status from the section's error and its rows' errors.
    pub fn finish(&mut self) {
        if self.status == Status::Skipped {
            return;
        }
        let first = self.error.clone().or_else(|| {
            self.rows
                .iter()
                .find_map(|r| r.error.as_ref().map(|e| format!("{}: {e}", row_label(r))))
        });
        self.status = if first.is_some() {
            Status::Failed
        } else {
            Status::Ok
        };
        self.reason = first;
    }

    /// Whether the section failed.
    pub fn failed(&self) -> bool {
        self.status == Status::Failed
    }
}

fn row_label(r: &Row) -> String {
    let mut s = r.series.clone();
    if let Some(v) = &r.variant {
        let _ = write!(s, " {v}");
    }
    if let Some(size) = r.size {
        let _ = write!(s, " {}", human(size));
    }
    if let Some(c) = r.count {
        let _ = write!(s, " x{c}");
    }
    s
}

/// The device a run used.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// Ordinal in this process.
    pub ordinal: usize,
    /// Marketing name.
    pub name: String,
    /// UUID.
    pub uuid: String,
    /// The driver's CUDA version.
    pub driver: String,
}

/// The second GPU of a `--devices A,B` run and how the two are linked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// The consumers' device (B).
    pub device: DeviceInfo,
    /// The link, in words: "NVLink (18 active links)", "PCIe (...)".
    pub link: String,
    /// Whether B can map A's memory (cuDeviceCanAccessPeer).
    pub access_supported: bool,
}

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

/// The numbers the targets use.
pub mod targets {
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
    /// PyTorch p50 / ours p50 for a fresh 64 MiB hand-off.
    pub const TORCH_SPEEDUP_64M: f64 = 4.0;
    /// The size of the PyTorch comparison.
    pub const TORCH_SIZE: u64 = 64 << 20;
    /// Run time, seconds (the limits).
    pub const QUICK_SECONDS: f64 = 180.0;
    /// Run time of a full run, seconds.
    pub const FULL_SECONDS: f64 = 480.0;
}

/// A whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The format of this document (1).
    pub schema: u32,
    /// "cuda-ipc bench" and the tool's version.
    pub tool: String,
    /// The command line.
    pub command: Vec<String>,
    /// Whether this was a `--quick` run.
    pub quick: bool,
    /// The device, once opened.
    pub device: Option<DeviceInfo>,
    /// The second device of a `--devices A,B` run.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub peer: Option<PeerInfo>,
    /// The mechanisms asked for.
    pub mechanisms: Vec<String>,
    /// The hand-off sizes, bytes.
    pub sizes: Vec<u64>,
    /// When the run started, seconds since the Unix epoch.
    pub started_unix_s: f64,
    /// How long the run took, seconds.
    pub elapsed_s: f64,
    /// The sections, in order.
    pub sections: Vec<Section>,
    /// Every target and its verdict.
    pub targets: Vec<TargetCheck>,
}

impl Report {
    /// The section `id`, if it is in the report.
    pub fn section(&self, id: SectionId) -> Option<&Section> {
        self.sections.iter().find(|s| s.id == id)
    }

    /// The first row of section `id` matching the series, variant and size.
    pub fn row(
        &self,
        id: SectionId,
        series: &str,
        variant: Option<&str>,
        size: Option<u64>,
    ) -> Option<&Row> {
        self.section(id)?.rows.iter().find(|r| {
            r.series == series
                && r.variant.as_deref() == variant
                && (size.is_none() || r.size == size)
                && r.error.is_none()
                && r.skipped.is_none()
        })
    }

    /// The median of [`Report::row`]'s row, if it was measured.
    pub fn p50(
        &self,
        id: SectionId,
        series: &str,
        variant: Option<&str>,
        size: Option<u64>,
    ) -> Option<f64> {
        self.row(id, series, variant, size).and_then(Row::p50)
    }

    /// The names of the sections that failed.
    pub fn failed_sections(&self) -> Vec<&'static str> {
        self.sections
            .iter()
            .filter(|s| s.failed())
            .map(|s| s.id.name())
            .collect()
    }

    /// Checks every target against the measurements and stores the verdicts.
    pub fn evaluate(&mut self) {
        self.targets = evaluate(self);
    }

    /// The report as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
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
            format!("<= {:.3} ms", targets::CACHED_P50_MS),
            row.p50().filter(|_| row.error.is_none()),
            |v| format!("{} ms", fmt_ms(v)),
            |v| v <= targets::CACHED_P50_MS,
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
                format!("<= {:.1}x", targets::FLOOR_RATIO),
                ours.zip(floor).map(|(o, f)| o / f),
                |v| format!("{v:.2}x"),
                |v| v <= targets::FLOOR_RATIO,
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
    let goal = targets::RING_FPS_4K;
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

fn torch_targets(r: &Report, out: &mut Vec<TargetCheck>) {
    let size = targets::TORCH_SIZE;
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
            format!(">= {:.0}x", targets::TORCH_SPEEDUP_64M),
            torch.zip(ours).map(|(t, o)| t / o),
            |v| format!("{v:.1}x"),
            |v| v >= targets::TORCH_SPEEDUP_64M,
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
        targets::BANDWIDTH_RATIO,
    );
    copy_targets(
        r,
        &mut out,
        SectionId::Peer,
        ("from_mapping", "memcpy_peer"),
        "copy out of a {m} peer mapping / cuMemcpyPeer (GB/s)",
        targets::PEER_BANDWIDTH_RATIO,
    );
    ring_targets(r, &mut out);
    torch_targets(r, &mut out);
    let limit = if r.quick {
        targets::QUICK_SECONDS
    } else {
        targets::FULL_SECONDS
    };
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

/// A size in binary units.
pub fn human(n: u64) -> String {
    cuda_ipc::units::ByteSize(n).to_string()
}

/// Milliseconds with enough digits for microsecond-scale figures.
pub fn fmt_ms(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v.abs() < 1.0 {
        format!("{v:.4}")
    } else if v.abs() < 100.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.1}")
    }
}

fn opt_ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), fmt_ms)
}

fn ratio(v: Option<f64>) -> String {
    v.filter(|v| v.is_finite())
        .map_or_else(|| "-".into(), |v| format!("{v:.2}x"))
}

/// A table of text cells: the first `left` columns left-aligned, the
/// others (numbers) right-aligned.
struct Table {
    header: Vec<String>,
    rows: Vec<Result<Vec<String>, String>>,
    left: usize,
}

impl Table {
    fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|s| (*s).to_string()).collect(),
            rows: Vec::new(),
            left: 1,
        }
    }

    fn left_aligned(mut self, columns: usize) -> Table {
        self.left = columns;
        self
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(Ok(cells));
    }

    /// A line across the table (a failure or a skip).
    fn line(&mut self, text: String) {
        self.rows.push(Err(text));
    }

    fn render(&self, out: &mut String) {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for r in self.rows.iter().flatten() {
            for (i, c) in r.iter().enumerate() {
                if i < widths.len() {
                    widths[i] = widths[i].max(c.chars().count());
                }
            }
        }
        let fmt_row = |cells: &[String]| {
            let mut s = String::from("  ");
            for (i, c) in cells.iter().enumerate() {
                let w = widths.get(i).copied().unwrap_or(0);
                let sep = if i == 0 { "" } else { "  " };
                if i < self.left {
                    let _ = write!(s, "{sep}{c:<w$}");
                } else {
                    let _ = write!(s, "{sep}{c:>w$}");
                }
            }
            s.trim_end().to_string()
        };
        let _ = writeln!(out, "{}", fmt_row(&self.header));
        for r in &self.rows {
            match r {
                Ok(cells) => {
                    let _ = writeln!(out, "{}", fmt_row(cells));
                }
                Err(text) => {
                    let _ = writeln!(out, "  {text}");
                }
            }
        }
    }
}

/// Why the row has no figures: "FAILED: ..." or "skipped: ...".
fn problem(r: &Row) -> Option<String> {
    match (&r.error, &r.skipped) {
        (Some(e), _) => Some(format!("FAILED: {e}")),
        (None, Some(s)) => Some(format!("skipped: {s}")),
        (None, None) => None,
    }
}

/// Adds the row's failure or skip as a line; true if it did.
fn problem_line(t: &mut Table, r: &Row, label: &str) -> bool {
    problem(r)
        .map(|p| t.line(format!("{label}: {p}")))
        .is_some()
}

fn label(r: &Row) -> String {
    row_label(r)
}

fn stat(r: &Row, f: impl Fn(&Stats) -> f64) -> String {
    r.stats
        .as_ref()
        .map_or_else(|| "-".into(), |s| fmt_ms(f(s)))
}

fn n(r: &Row) -> String {
    r.stats.map_or_else(|| "0".into(), |s| s.n.to_string())
}

/// A latency table: a first column named `first`, then size, n, p50, p90,
/// p99 and the `extra` columns, one line per row of `rows` (its failure or
/// skip as a line across); `first_cell` and `extra_cells` fill a line.
/// Nothing is printed without rows.
fn render_latency<'a>(
    rows: impl Iterator<Item = &'a Row>,
    first: &str,
    extra: &[&str],
    first_cell: impl Fn(&Row) -> String,
    extra_cells: impl Fn(&Row) -> Vec<String>,
    out: &mut String,
) {
    let mut header = vec![first, "size", "n", "p50", "p90", "p99"];
    header.extend_from_slice(extra);
    let mut t = Table::new(&header);
    let mut any = false;
    for row in rows {
        any = true;
        if problem_line(&mut t, row, &label(row)) {
            continue;
        }
        let mut cells = vec![
            first_cell(row),
            row.size.map_or_else(|| "-".into(), human),
            n(row),
            stat(row, |s| s.p50),
            stat(row, |s| s.p90),
            stat(row, |s| s.p99),
        ];
        cells.extend(extra_cells(row));
        t.row(cells);
    }
    if any {
        t.render(out);
    }
}

/// The series name (the mechanism): the first cell of most tables.
fn series(row: &Row) -> String {
    row.series.clone()
}

/// Ours against another p50: that p50 and ours / it.
fn against(ours: Option<f64>, other: Option<f64>) -> [String; 2] {
    [opt_ms(other), ratio(ours.zip(other).map(|(o, x)| o / x))]
}

fn render_fresh(r: &Report, s: &Section, out: &mut String) {
    render_latency(
        s.rows.iter(),
        "mech",
        &[
            "publish",
            "consumer",
            "floor p50",
            "ours/floor",
            "PyTorch p50",
            "PyTorch/ours",
        ],
        series,
        |row| {
            let floor = r.p50(
                SectionId::Floor,
                &format!("{} floor", row.series),
                None,
                row.size,
            );
            let torch = r.p50(SectionId::Torch, "PyTorch", Some("fresh"), row.size);
            let ours = row.p50();
            let mut cells = vec![
                opt_ms(row.part_p50("publish")),
                opt_ms(row.part_p50("consumer")),
            ];
            cells.extend(against(ours, floor));
            cells.push(opt_ms(torch));
            cells.push(ratio(torch.zip(ours).map(|(t, o)| t / o)));
            cells
        },
        out,
    );
}

fn render_cached(r: &Report, s: &Section, out: &mut String) {
    render_latency(
        s.rows.iter(),
        "mech",
        &["target", "PyTorch repeat p50", "PyTorch/ours"],
        series,
        |row| {
            let torch = r.p50(SectionId::Torch, "PyTorch", Some("repeat"), row.size);
            let ours = row.p50();
            vec![
                match ours {
                    Some(v) if v <= targets::CACHED_P50_MS => "PASS".into(),
                    Some(_) => "MISS".into(),
                    None => "-".into(),
                },
                opt_ms(torch),
                ratio(torch.zip(ours).map(|(t, o)| t / o)),
            ]
        },
        out,
    );
}

fn render_floor(s: &Section, out: &mut String) {
    render_latency(
        s.rows.iter(),
        "floor",
        &["export p50", "open+wait p50", "close p50"],
        series,
        |row| {
            ["export", "open", "close"]
                .map(|part| opt_ms(row.part_p50(part)))
                .to_vec()
        },
        out,
    );
}

/// A GB/s median, rounded.
fn gbs(r: Option<&Row>) -> String {
    r.and_then(Row::p50)
        .map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}

/// A table of copy bandwidths: one line per series (mechanism) with the
/// median GB/s of each variant in `columns` (header, variant), and the
/// ratio of `ratio`'s numerator and denominator variants under its header.
fn render_copies(
    s: &Section,
    columns: &[(&str, &str)],
    ratio: (&str, &str, &str),
    suffix: &str,
    out: &mut String,
) {
    let mut header = vec!["mech", "size", "n"];
    header.extend(columns.iter().map(|(h, _)| *h));
    header.push(ratio.0);
    let mut t = Table::new(&header);
    let copies: Vec<&Row> = s.rows.iter().filter(|r| r.unit == "GB/s").collect();
    let mut series: Vec<&str> = Vec::new();
    for row in &copies {
        if !series.contains(&row.series.as_str()) {
            series.push(&row.series);
        }
    }
    for m in &series {
        let rows: Vec<&Row> = copies.iter().copied().filter(|r| r.series == *m).collect();
        if let Some(bad) = rows
            .iter()
            .find(|r| r.error.is_some() || r.skipped.is_some())
        {
            problem_line(&mut t, bad, &format!("{m}{suffix}"));
            continue;
        }
        let get = |v: &str| {
            rows.iter()
                .find(|r| r.variant.as_deref() == Some(v))
                .copied()
        };
        let first = get(columns[0].1);
        let mut cells = vec![
            (*m).to_string(),
            first.and_then(|r| r.size).map(human).unwrap_or_default(),
            first.map(n).unwrap_or_default(),
        ];
        cells.extend(columns.iter().map(|(_, v)| gbs(get(v))));
        cells.push(
            get(ratio.1)
                .and_then(Row::p50)
                .zip(get(ratio.2).and_then(Row::p50))
                .map_or_else(|| "-".into(), |(a, b)| format!("{:.3}", a / b)),
        );
        t.row(cells);
    }
    if !series.is_empty() {
        t.render(out);
    }
}

fn render_bandwidth(s: &Section, out: &mut String) {
    render_copies(
        s,
        &[
            ("from mapping GB/s", "from_mapping"),
            ("local GB/s", "local"),
            ("into mapping GB/s", "into_mapping"),
        ],
        ("from/local", "from_mapping", "local"),
        "",
        out,
    );
}

/// The peer section: fresh hand-offs to a consumer on the other GPU next
/// to the cross-GPU floor and the same-GPU figures, cached hand-offs, then
/// the copies.
fn render_peer(r: &Report, s: &Section, out: &mut String) {
    let ms = |row: &&Row| row.unit == "ms";
    render_latency(
        s.rows
            .iter()
            .filter(ms)
            .filter(|row| row.variant.is_none() && !row.series.ends_with(" floor")),
        "mech",
        &[
            "publish",
            "consumer",
            "floor p50",
            "ours/floor",
            "same GPU p50",
            "across/same",
        ],
        series,
        |row| {
            let floor = r.p50(
                SectionId::Peer,
                &format!("{} floor", row.series),
                None,
                row.size,
            );
            let same = r.p50(SectionId::Fresh, &row.series, None, row.size);
            let mut cells = vec![
                opt_ms(row.part_p50("publish")),
                opt_ms(row.part_p50("consumer")),
            ];
            cells.extend(against(row.p50(), floor));
            cells.extend(against(row.p50(), same));
            cells
        },
        out,
    );
    // The floor rows show in the columns above, or here if they failed.
    for row in s.rows.iter().filter(ms) {
        if let Some(p) = problem(row).filter(|_| row.series.ends_with(" floor")) {
            let _ = writeln!(out, "  {}: {p}", label(row));
        }
    }
    render_latency(
        s.rows
            .iter()
            .filter(|row| row.variant.as_deref() == Some("cached")),
        "cached",
        &["same GPU p50", "across/same"],
        series,
        |row| {
            let same = r.p50(SectionId::Cached, &row.series, None, row.size);
            against(row.p50(), same).to_vec()
        },
        out,
    );
    render_copies(
        s,
        &[
            ("from peer mapping GB/s", "from_mapping"),
            ("cuMemcpyPeer GB/s", "memcpy_peer"),
            ("local GB/s", "local"),
            ("into peer mapping GB/s", "into_mapping"),
        ],
        ("mapping/cuMemcpyPeer", "from_mapping", "memcpy_peer"),
        " copies",
        out,
    );
}

fn render_ring(s: &Section, out: &mut String) {
    let mut t = Table::new(&[
        "mech",
        "frame",
        "slots",
        "frames",
        "frames/s",
        "load p50",
        "load p99",
        "paced p50",
        "paced p99",
    ]);
    for row in s
        .rows
        .iter()
        .filter(|r| r.variant.as_deref() != Some("paced"))
    {
        if problem_line(&mut t, row, &label(row)) {
            continue;
        }
        let paced = s.rows.iter().find(|p| {
            p.variant.as_deref() == Some("paced") && p.series == row.series && p.size == row.size
        });
        t.row(vec![
            row.series.clone(),
            row.size.map(human).unwrap_or_default(),
            row.count.map(|c| c.to_string()).unwrap_or_default(),
            n(row),
            row.value.map_or_else(|| "-".into(), |v| format!("{v:.0}")),
            stat(row, |s| s.p50),
            stat(row, |s| s.p99),
            paced.map_or_else(|| "-".into(), |p| stat(p, |s| s.p50)),
            paced.map_or_else(|| "-".into(), |p| stat(p, |s| s.p99)),
        ]);
    }
    t.render(out);
}

fn render_scale(s: &Section, out: &mut String) {
    let mut t = Table::new(&[
        "consumers",
        "size",
        "n",
        "p50",
        "p90",
        "p99",
        "slowest p50",
        "vs 1 consumer",
    ]);
    let one = s
        .rows
        .iter()
        .find(|r| r.variant.as_deref() == Some("consumers") && r.count == Some(1))
        .and_then(Row::p50);
    for row in s
        .rows
        .iter()
        .filter(|r| r.variant.as_deref() == Some("consumers"))
    {
        if problem_line(&mut t, row, &label(row)) {
            continue;
        }
        let slowest = s
            .rows
            .iter()
            .find(|x| x.variant.as_deref() == Some("slowest_consumer") && x.count == row.count);
        t.row(vec![
            row.count.map(|c| c.to_string()).unwrap_or_default(),
            row.size.map(human).unwrap_or_default(),
            n(row),
            stat(row, |s| s.p50),
            stat(row, |s| s.p90),
            stat(row, |s| s.p99),
            slowest.map_or_else(|| "-".into(), |x| stat(x, |s| s.p50)),
            ratio(row.p50().zip(one).map(|(a, b)| a / b)),
        ]);
    }
    t.render(out);
    for row in s
        .rows
        .iter()
        .filter(|r| r.variant.as_deref() == Some("slope"))
    {
        if let Some(e) = &row.error {
            let _ = writeln!(out, "  slope: FAILED: {e}");
        } else {
            let _ = write!(
                out,
                "  slope: {} ms per extra consumer (least squares over the p50s)",
                opt_ms(row.value),
            );
            if let Some(v) = row.part_p50("slowest") {
                let _ = write!(out, ", {} ms for the slowest", fmt_ms(v));
            }
            let _ = writeln!(out);
        }
    }
    let mut t = Table::new(&[
        "live entries",
        "size",
        "n",
        "p50",
        "p90",
        "p99",
        "vs 1 consumer",
    ]);
    let mut any = false;
    for row in s
        .rows
        .iter()
        .filter(|r| r.variant.as_deref() == Some("live_entries"))
    {
        any = true;
        if problem_line(&mut t, row, &label(row)) {
            continue;
        }
        t.row(vec![
            row.count.map(|c| c.to_string()).unwrap_or_default(),
            row.size.map(human).unwrap_or_default(),
            n(row),
            stat(row, |s| s.p50),
            stat(row, |s| s.p90),
            stat(row, |s| s.p99),
            ratio(row.p50().zip(one).map(|(a, b)| a / b)),
        ]);
    }
    if any {
        t.render(out);
    }
}

fn render_torch(s: &Section, out: &mut String) {
    render_latency(
        s.rows.iter(),
        "mode",
        &[],
        |row| row.variant.clone().unwrap_or_default(),
        |_| Vec::new(),
        out,
    );
}

/// The table printed at the end of a run.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    let device = r.device.as_ref().map_or_else(
        || "no device".to_string(),
        |d| {
            format!(
                "{} (device {}, {}), driver CUDA {}",
                d.name, d.ordinal, d.uuid, d.driver
            )
        },
    );
    let _ = writeln!(
        out,
        "cuda-ipc bench: {device}; {} run in {:.1} s",
        if r.quick { "quick" } else { "full" },
        r.elapsed_s
    );
    if let Some(p) = &r.peer {
        let _ = writeln!(
            out,
            "second GPU: {} (device {}, {}); link {}; peer access {}",
            p.device.name,
            p.device.ordinal,
            p.device.uuid,
            p.link,
            if p.access_supported { "yes" } else { "no" }
        );
    }
    let _ = writeln!(
        out,
        "Latencies are one way, in ms: the producer's CLOCK_MONOTONIC before the call to the consumer's \
         after its wait completed; p50/p90/p99 over the samples kept after warm-up."
    );
    for (i, s) in r.sections.iter().enumerate() {
        let _ = writeln!(out);
        let status = match s.status {
            Status::Ok => String::new(),
            Status::Failed => "  [FAILED]".into(),
            Status::Skipped => format!("  [skipped: {}]", s.reason.as_deref().unwrap_or("")),
        };
        let _ = writeln!(
            out,
            "[{}] {} ({:.1} s){status}",
            i + 1,
            s.id.title(),
            s.seconds
        );
        if let Some(e) = &s.error {
            let _ = writeln!(out, "  FAILED: {e}");
        }
        match s.id {
            SectionId::Fresh => render_fresh(r, s, &mut out),
            SectionId::Cached => render_cached(r, s, &mut out),
            SectionId::Floor => render_floor(s, &mut out),
            SectionId::Bandwidth => render_bandwidth(s, &mut out),
            SectionId::Peer => render_peer(r, s, &mut out),
            SectionId::Ring => render_ring(s, &mut out),
            SectionId::Scale => render_scale(s, &mut out),
            SectionId::Torch => render_torch(s, &mut out),
        }
        for note in &s.notes {
            let _ = writeln!(out, "  * {note}");
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "Targets");
    let mut t = Table::new(&["verdict", "what", "target", "measured"]).left_aligned(4);
    for c in &r.targets {
        t.row(vec![
            match c.verdict {
                Verdict::Pass => "PASS",
                Verdict::Miss => "MISS",
                Verdict::NotMeasured => "----",
            }
            .into(),
            c.what.clone(),
            c.target.clone(),
            c.shown.clone(),
        ]);
    }
    t.render(&mut out);
    let count = |v| r.targets.iter().filter(|c| c.verdict == v).count();
    let failed = r.failed_sections();
    let _ = writeln!(
        out,
        "{} targets: {} PASS, {} MISS, {} not measured; {}",
        r.targets.len(),
        count(Verdict::Pass),
        count(Verdict::Miss),
        count(Verdict::NotMeasured),
        if failed.is_empty() {
            "every section completed".to_string()
        } else {
            format!("FAILED sections: {}", failed.join(", "))
        }
    );
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn lat(series: &str, size: u64, samples: &[f64]) -> Row {
        Row::new(series, "ms")
            .size(size)
            .samples(5, samples.to_vec())
    }

    /// A report with every section filled with synthetic numbers.
    #[allow(clippy::too_many_lines)] // one report with every section
    pub(crate) fn synthetic() -> Report {
        let mib2 = 2 << 20;
        let mib64 = 64 << 20;
        let mut fresh = Section::new(SectionId::Fresh);
        fresh.rows = vec![
            lat("legacy", mib2, &[0.10, 0.11, 0.12]).part("publish", &[0.01, 0.01, 0.01]),
            lat("legacy", mib64, &[0.12, 0.13, 0.14]),
            lat("vmm", mib2, &[0.30, 0.31, 0.32]),
            lat("vmm", mib64, &[0.30, 0.31, 0.32]),
            Row::new("pool", "ms")
                .size(mib2)
                .failed("allocating 2MiB: out of memory"),
        ];
        let mut cached = Section::new(SectionId::Cached);
        cached.rows = vec![
            lat("legacy", mib2, &[0.015, 0.016, 0.017]),
            lat("vmm", mib2, &[0.025, 0.026, 0.027]),
        ];
        let mut floor = Section::new(SectionId::Floor);
        floor.rows = vec![
            lat("legacy floor", mib2, &[0.08, 0.09, 0.10]).part("export", &[0.005]),
            lat("legacy floor", mib64, &[0.10, 0.10, 0.10]),
            lat("vmm floor", mib2, &[0.25, 0.25, 0.25]),
            lat("vmm floor", mib64, &[0.15, 0.15, 0.15]),
            Row::new("pipe", "ms").samples(0, vec![0.02, 0.02]),
        ];
        let mut bw = Section::new(SectionId::Bandwidth);
        let gbs = |m: &str, v: &str, x: f64| {
            Row::new(m, "GB/s")
                .variant(v)
                .size(256 << 20)
                .samples(3, vec![x, x, x])
        };
        bw.rows = vec![
            gbs("legacy", "from_mapping", 4200.0),
            gbs("legacy", "local", 4250.0),
            gbs("legacy", "into_mapping", 4240.0),
            gbs("vmm", "from_mapping", 3000.0),
            gbs("vmm", "local", 4250.0),
            gbs("vmm", "into_mapping", 4240.0),
        ];
        let mut peer = Section::new(SectionId::Peer);
        peer.rows = vec![
            lat("legacy", mib2, &[0.20, 0.22, 0.24]),
            lat("vmm", mib2, &[0.62, 0.62, 0.62]),
            lat("legacy floor", mib2, &[0.10, 0.11, 0.12]),
            lat("legacy", mib2, &[0.05, 0.05, 0.05]).variant("cached"),
            Row::new("vmm floor", "ms")
                .size(mib2)
                .skip("no floor today"),
            gbs("legacy", "from_mapping", 700.0),
            gbs("legacy", "memcpy_peer", 710.0),
            gbs("legacy", "local", 4250.0),
            gbs("legacy", "into_mapping", 690.0),
            gbs("vmm", "from_mapping", 500.0),
            gbs("vmm", "memcpy_peer", 710.0),
            gbs("vmm", "local", 4250.0),
            gbs("vmm", "into_mapping", 690.0),
            Row::new("pool", "GB/s")
                .variant("from_mapping")
                .skip("pool sharing is off here"),
        ];
        let mut ring = Section::new(SectionId::Ring);
        let mut r4k = Row::new("vmm", "ms")
            .variant("load")
            .size(4096)
            .count(64)
            .samples(0, vec![0.2, 0.3]);
        r4k.value = Some(123_456.0);
        let mut r1m = Row::new("vmm", "ms")
            .variant("load")
            .size(1 << 20)
            .count(32)
            .samples(0, vec![0.4]);
        r1m.value = Some(50_000.0);
        ring.rows = vec![
            r4k,
            Row::new("vmm", "ms")
                .variant("paced")
                .size(4096)
                .samples(0, vec![0.05]),
            r1m,
        ];
        let mut scale = Section::new(SectionId::Scale);
        let mut slope = Row::new("vmm", "ms/consumer").variant("slope");
        slope.value = Some(0.0123);
        scale.rows = vec![
            Row::new("vmm", "ms")
                .variant("consumers")
                .count(1)
                .size(mib2)
                .samples(5, vec![0.3]),
            Row::new("vmm", "ms")
                .variant("consumers")
                .count(2)
                .size(mib2)
                .samples(5, vec![0.32]),
            slope,
            Row::new("vmm", "ms")
                .variant("live_entries")
                .count(100)
                .size(mib2)
                .samples(5, vec![0.35]),
        ];
        let mut torch = Section::new(SectionId::Torch);
        torch.rows = vec![
            Row::new("PyTorch", "ms")
                .variant("fresh")
                .size(mib2)
                .samples(5, vec![0.5, 0.6]),
            Row::new("PyTorch", "ms")
                .variant("fresh")
                .size(mib64)
                .samples(5, vec![0.6, 0.7]),
            Row::new("PyTorch", "ms")
                .variant("repeat")
                .size(mib2)
                .samples(5, vec![0.2]),
        ];
        torch.notes.push("PyTorch 2.11.0".into());
        let mut r = Report {
            schema: 1,
            tool: "cuda-ipc bench 0.1.0".into(),
            command: vec!["cuda-ipc".into(), "bench".into(), "--quick".into()],
            quick: true,
            device: Some(DeviceInfo {
                ordinal: 0,
                name: "NVIDIA H200".into(),
                uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
                driver: "13.0".into(),
            }),
            peer: Some(PeerInfo {
                device: DeviceInfo {
                    ordinal: 1,
                    name: "NVIDIA H200".into(),
                    uuid: "GPU-11111111-0000-0000-0000-000000000000".into(),
                    driver: "13.0".into(),
                },
                link: "NVLink (18 active links)".into(),
                access_supported: true,
            }),
            mechanisms: vec!["legacy".into(), "vmm".into(), "pool".into()],
            sizes: vec![mib2, mib64],
            started_unix_s: 0.0,
            elapsed_s: 42.0,
            sections: vec![fresh, cached, floor, bw, peer, ring, scale, torch],
            targets: Vec::new(),
        };
        for s in &mut r.sections {
            s.finish();
        }
        r.evaluate();
        r
    }

    fn verdict(r: &Report, id: &str) -> Verdict {
        r.targets
            .iter()
            .find(|t| t.id == id)
            .unwrap_or_else(|| panic!("no target {id} in {:#?}", r.targets))
            .verdict
    }

    #[test]
    fn targets_pass_and_miss() {
        let r = synthetic();
        assert_eq!(verdict(&r, "cached/legacy/2MiB"), Verdict::Pass);
        assert_eq!(verdict(&r, "cached/vmm/2MiB"), Verdict::Miss);
        // legacy 2 MiB: 0.11 / 0.09 = 1.22 (pass); 64 MiB: 0.13 / 0.10 = 1.3 (pass)
        assert_eq!(verdict(&r, "floor/legacy/2MiB"), Verdict::Pass);
        // vmm 64 MiB: 0.31 / 0.15 = 2.07 (miss)
        assert_eq!(verdict(&r, "floor/vmm/64MiB"), Verdict::Miss);
        assert_eq!(verdict(&r, "bandwidth/legacy"), Verdict::Pass);
        assert_eq!(verdict(&r, "bandwidth/vmm"), Verdict::Miss);
        // pool's bandwidth was never measured
        assert_eq!(verdict(&r, "bandwidth/pool"), Verdict::NotMeasured);
        // peer copies: legacy 700 / 710 = 0.986 (pass), vmm 500 / 710 (miss);
        // pool's were skipped, so no target
        assert_eq!(verdict(&r, "peer/legacy"), Verdict::Pass);
        assert_eq!(verdict(&r, "peer/vmm"), Verdict::Miss);
        assert!(r.targets.iter().all(|t| t.id != "peer/pool"));
        assert_eq!(verdict(&r, "ring/vmm/4KiB"), Verdict::Pass);
        // PyTorch 64 MiB p50 0.65 / legacy 0.13 = 5x (pass), / vmm 0.31 = 2.1x (miss)
        assert_eq!(verdict(&r, "torch/legacy/64MiB"), Verdict::Pass);
        assert_eq!(verdict(&r, "torch/vmm/64MiB"), Verdict::Miss);
        assert_eq!(verdict(&r, "runtime"), Verdict::Pass);
        let t = r
            .targets
            .iter()
            .find(|t| t.id == "torch/legacy/64MiB")
            .unwrap();
        assert!((t.measured.unwrap() - 0.65 / 0.13).abs() < 1e-9);
    }

    #[test]
    fn failed_rows_fail_their_section() {
        let r = synthetic();
        assert_eq!(r.failed_sections(), vec!["fresh"]);
        let s = r.section(SectionId::Fresh).unwrap();
        assert_eq!(s.status, Status::Failed);
        let why = s.reason.as_deref().unwrap();
        assert!(
            why.contains("pool 2MiB") && why.contains("out of memory"),
            "{why}"
        );
    }

    #[test]
    fn torch_skipped_is_not_measured() {
        let mut r = synthetic();
        let i = r
            .sections
            .iter()
            .position(|s| s.id == SectionId::Torch)
            .unwrap();
        r.sections[i] = Section::skipped(SectionId::Torch, "no module named torch");
        r.evaluate();
        let t = r
            .targets
            .iter()
            .find(|t| t.id == "torch/legacy/64MiB")
            .unwrap();
        assert_eq!(t.verdict, Verdict::NotMeasured);
        assert_eq!(t.shown, "PyTorch skipped");
        let text = render(&r);
        assert!(text.contains("[skipped: no module named torch]"), "{text}");
    }

    #[test]
    fn table_shows_every_section_and_verdict() {
        let r = synthetic();
        let text = render(&r);
        for s in SectionId::ALL {
            assert!(text.contains(s.title()), "{}: {text}", s.title());
        }
        assert!(text.contains("PASS") && text.contains("MISS"), "{text}");
        assert!(
            text.contains("pool 2MiB: FAILED: allocating 2MiB: out of memory"),
            "{text}"
        );
        assert!(text.contains("FAILED sections: fresh"), "{text}");
        // ours/floor for legacy 2 MiB: 0.11 / 0.09
        assert!(text.contains("1.22x"), "{text}");
        // the ring's frames per second
        assert!(text.contains("123456"), "{text}");
        assert!(text.contains("0.0123 ms per extra consumer"), "{text}");
        // the second GPU and the peer section: across/same for legacy 2 MiB
        // is 0.22 / 0.11, the copy ratio 700 / 710
        assert!(
            text.contains("second GPU: NVIDIA H200 (device 1,")
                && text.contains("link NVLink (18 active links); peer access yes"),
            "{text}"
        );
        let peer: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.contains("Across two GPUs"))
            .take(12)
            .collect();
        // legacy 2 MiB: ours / peer floor = 0.22 / 0.11, across / same the same
        assert!(
            peer[2].trim_start().starts_with("legacy") && peer[2].matches("2.00x").count() == 2,
            "{peer:?}"
        );
        assert!(
            peer[4].contains("vmm floor 2MiB: skipped: no floor today"),
            "{peer:?}"
        );
        // cached across GPUs: 0.05 against 0.016 on one GPU
        assert!(
            peer[6].trim_start().starts_with("legacy") && peer[6].ends_with("3.12x"),
            "{peer:?}"
        );
        assert!(
            peer[8].trim_start().starts_with("legacy") && peer[8].ends_with("0.986"),
            "{peer:?}"
        );
        assert!(
            peer[10].contains("pool copies: skipped: pool sharing is off here"),
            "{peer:?}"
        );
        // cached: legacy passes, vmm misses in the table's own column
        let cached: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.contains("Cached hand-off"))
            .take(4)
            .collect();
        assert!(
            cached[2].trim_start().starts_with("legacy") && cached[2].contains("PASS"),
            "{cached:?}"
        );
        assert!(
            cached[3].trim_start().starts_with("vmm") && cached[3].contains("MISS"),
            "{cached:?}"
        );
    }

    #[test]
    fn json_has_the_documented_shape() {
        let r = synthetic();
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(v["schema"], 1);
        assert_eq!(v["quick"], true);
        assert_eq!(v["device"]["name"], "NVIDIA H200");
        assert_eq!(v["sizes"][1], 64 << 20);
        let sections = v["sections"].as_array().unwrap();
        assert_eq!(sections.len(), 8);
        assert_eq!(v["peer"]["device"]["ordinal"], 1);
        assert_eq!(v["peer"]["link"], "NVLink (18 active links)");
        assert_eq!(sections[4]["id"], "peer");
        assert_eq!(sections[4]["rows"][6]["variant"], "memcpy_peer");
        assert_eq!(sections[0]["id"], "fresh");
        assert_eq!(sections[0]["status"], "failed");
        assert!(sections[0]["error"].is_null());
        assert!(
            sections[0]["reason"]
                .as_str()
                .unwrap()
                .contains("out of memory")
        );
        assert_eq!(sections[1]["status"], "ok");
        let row = &sections[0]["rows"][0];
        assert_eq!(row["series"], "legacy");
        assert_eq!(row["size"], 2 << 20);
        assert_eq!(row["unit"], "ms");
        assert_eq!(row["warmup"], 5);
        assert_eq!(row["samples"].as_array().unwrap().len(), 3);
        assert!((row["stats"]["p50"].as_f64().unwrap() - 0.11).abs() < 1e-12);
        assert!(row["stats"]["p90"].is_number() && row["stats"]["p99"].is_number());
        assert!(row["parts"]["publish"]["p50"].is_number());
        assert_eq!(
            sections[0]["rows"][4]["error"],
            "allocating 2MiB: out of memory"
        );
        let t = v["targets"].as_array().unwrap();
        assert!(
            t.iter()
                .any(|t| t["id"] == "cached/vmm/2MiB" && t["verdict"] == "miss")
        );
        assert!(t.iter().any(|t| t["verdict"] == "pass"));
        let skipped = serde_json::to_value(Section::skipped(SectionId::Torch, "why")).unwrap();
        assert_eq!(skipped["status"], "skipped");
        assert_eq!(skipped["reason"], "why");
        // and it reads back
        let back: Report = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    #[ignore = "prints the synthetic table to look at"]
    fn print_table() {
        println!("{}", render(&synthetic()));
    }

    #[test]
    fn section_names_parse() {
        for s in SectionId::ALL {
            assert_eq!(SectionId::parse(s.name()).unwrap(), s);
        }
        assert!(
            SectionId::parse("nope")
                .unwrap_err()
                .contains("fresh, cached")
        );
    }

    #[test]
    fn ms_formatting() {
        assert_eq!(fmt_ms(0.0153), "0.0153");
        assert_eq!(fmt_ms(1.5), "1.500");
        assert_eq!(fmt_ms(3100.0), "3100.0");
        assert_eq!(fmt_ms(f64::NAN), "-");
    }
}
