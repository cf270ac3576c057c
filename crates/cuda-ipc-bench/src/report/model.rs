//! The model of a run: sections of rows with raw samples and summaries,
//! the devices, and the whole report as one JSON document. Pure data; no GPU.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::format::human;
use crate::stats::Stats;

/// The sections of a run, in the order they run and print.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SectionId {
    /// A new buffer each time: publish to a synchronised mapping.
    Fresh,
    /// A new buffer from an arena (its chunk exported once) each time.
    Arena,
    /// KV-cache blocks pushed to a stream's subscriber (and pulled).
    Push,
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
    /// Interprocess events against GPU-side fences, next to a floor.
    Sync,
    /// Several consumers, many live entries.
    Scale,
    /// A weight set of many tensors: ours, PyTorch's list and bucket.
    Sets,
    /// torch.multiprocessing's hand-off.
    Torch,
}

impl SectionId {
    /// Every section, in order.
    pub const ALL: [SectionId; 12] = [
        SectionId::Fresh,
        SectionId::Arena,
        SectionId::Push,
        SectionId::Cached,
        SectionId::Floor,
        SectionId::Bandwidth,
        SectionId::Peer,
        SectionId::Ring,
        SectionId::Sync,
        SectionId::Scale,
        SectionId::Sets,
        SectionId::Torch,
    ];

    /// The name used on the command line (`--only`) and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            SectionId::Fresh => "fresh",
            SectionId::Arena => "arena",
            SectionId::Push => "push",
            SectionId::Cached => "cached",
            SectionId::Floor => "floor",
            SectionId::Bandwidth => "bandwidth",
            SectionId::Peer => "peer",
            SectionId::Ring => "ring",
            SectionId::Sync => "sync",
            SectionId::Scale => "scale",
            SectionId::Sets => "sets",
            SectionId::Torch => "torch",
        }
    }

    /// The heading in the table.
    pub fn title(self) -> &'static str {
        match self {
            SectionId::Fresh => "Fresh hand-off",
            SectionId::Arena => "Fresh hand-off from an arena",
            SectionId::Push => "KV blocks pushed (and pulled)",
            SectionId::Cached => "Cached hand-off",
            SectionId::Floor => "Driver floor",
            SectionId::Bandwidth => "Bandwidth through a mapping",
            SectionId::Peer => "Across two GPUs",
            SectionId::Ring => "Streaming ring",
            SectionId::Sync => "Events against fences",
            SectionId::Scale => "Scale",
            SectionId::Sets => "Weight sets",
            SectionId::Torch => "PyTorch anchor",
        }
    }

    /// Parses a section name.
    pub fn parse(s: &str) -> Result<SectionId, String> {
        SectionId::ALL
            .into_iter()
            .find(|id| id.name().eq_ignore_ascii_case(s.trim()))
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
    /// "repeat" (PyTorch), "set", "update" (ours, sets), "list", "bucket"
    /// (PyTorch, sets).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub variant: Option<String>,
    /// The buffer or frame size in bytes.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub size: Option<u64>,
    /// Consumers, live entries, ring slots or the tensors of a weight set.
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
    /// Device memory the hand-off needed beyond the buffers handed off, in
    /// bytes (the sets section: PyTorch's bucket copy; 0 where none).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub extra_device_bytes: Option<u64>,
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

    /// Sets the extra device memory.
    #[must_use]
    pub fn extra_device_bytes(mut self, bytes: u64) -> Row {
        self.extra_device_bytes = Some(bytes);
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

    pub(crate) fn part_p50(&self, name: &str) -> Option<f64> {
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
    /// Whether it ran under a private MPS control daemon (the second pass
    /// of a `--mps` run); the same section without MPS comes first.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub mps: bool,
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
            mps: false,
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

    /// Its name in a list: "ring", or "ring under MPS".
    pub fn label(&self) -> String {
        if self.mps {
            format!("{} under MPS", self.id.name())
        } else {
            self.id.name().to_string()
        }
    }

    /// Its heading: "Streaming ring", or "Streaming ring, under MPS".
    pub fn title(&self) -> String {
        if self.mps {
            format!("{}, under MPS", self.id.title())
        } else {
            self.id.title().to_string()
        }
    }
}

/// The pass under MPS of a `--mps` run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MpsPass {
    /// The private control daemon's pipe directory (gone after the run).
    pub pipe_directory: String,
    /// Whether the driver said the pass's contexts went through MPS
    /// (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`; absent where it does not say).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub driver_says_mps: Option<bool>,
    /// Why the pass, or stopping the daemon, failed.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
}

pub(super) fn row_label(r: &Row) -> String {
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
    /// The namespaces every consumer process ran in besides the
    /// producer's (`--consumer-namespaces`: pid, ipc, mount, user, shm);
    /// empty when they ran in the producer's.
    #[serde(default)]
    pub consumer_namespaces: Vec<String>,
    /// The command line a consumer ran under ("unshare ... -- CONSUMER"),
    /// empty when it ran directly.
    #[serde(skip_serializing_if = "String::is_empty", default)]
    pub consumer_command: String,
    /// When the run started, seconds since the Unix epoch.
    pub started_unix_s: f64,
    /// How long the run took, seconds.
    pub elapsed_s: f64,
    /// The sections, in order (with `--mps`, those under MPS after the others).
    pub sections: Vec<Section>,
    /// The pass under MPS, in a `--mps` run.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub mps: Option<MpsPass>,
    /// How long the run's processes polled for each other's next message
    /// before they slept, µs (`CUDA_IPC_BENCH_AWAKE_US`; 0: they slept at
    /// once, the default).
    #[serde(skip_serializing_if = "is_zero", default)]
    pub awake_us: u64,
    /// How this machine's processors idle, which a sleeping consumer's
    /// wake-up pays for (read when the run started; absent in reports
    /// written before it was kept).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub idle: Option<crate::idle::IdleStates>,
    /// Every target and its verdict.
    pub targets: Vec<TargetCheck>,
}

impl Report {
    /// The section `id` without MPS, if it is in the report (the targets
    /// are checked against these).
    pub fn section(&self, id: SectionId) -> Option<&Section> {
        self.sections.iter().find(|s| s.id == id && !s.mps)
    }

    /// The first measured row of section `id` matching the series, variant
    /// and count (any size).
    pub fn row_of_count(
        &self,
        id: SectionId,
        series: &str,
        variant: &str,
        count: u64,
    ) -> Option<&Row> {
        self.section(id)?.rows.iter().find(|r| {
            r.series == series
                && r.variant.as_deref() == Some(variant)
                && r.count == Some(count)
                && r.error.is_none()
                && r.skipped.is_none()
        })
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

    /// The names of the sections that failed ("ring under MPS" for one
    /// under MPS).
    pub fn failed_sections(&self) -> Vec<String> {
        self.sections
            .iter()
            .filter(|s| s.failed())
            .map(Section::label)
            .collect()
    }

    /// The report as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

/// Whether a count is zero (serde leaves such a field out).
#[allow(clippy::trivially_copy_pass_by_ref)] // serde passes a reference
fn is_zero(n: &u64) -> bool {
    *n == 0
}
