//! The text table a run prints: one block per section, then the targets.
//! Pure formatting; no GPU.

use std::fmt::Write as _;

use super::format::{fmt_ms, human};
use super::model::{Report, Row, Section, SectionId, Status, Verdict, row_label};
use super::targets;
use crate::stats::Stats;

mod copies;
mod sets;
use copies::{render_bandwidth, render_peer};
use sets::render_sets;

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

/// Under a table of hand-offs, a line per row whose calls were clocked
/// phase by phase (parts named `CALL: PHASE`): its largest phases by p50,
/// largest first, so a reader sees where the hand-off went.
fn phase_lines<'a>(rows: impl Iterator<Item = &'a Row>, out: &mut String) {
    const SHOWN: usize = 6;
    for row in rows {
        let mut phases: Vec<(&str, f64)> = row
            .parts
            .iter()
            .filter(|(name, _)| name.contains(": "))
            .map(|(name, s)| (name.as_str(), s.p50))
            .collect();
        if phases.is_empty() || row.stats.is_none() {
            continue;
        }
        phases.sort_by(|a, b| b.1.total_cmp(&a.1));
        let shown: Vec<String> = phases
            .iter()
            .take(SHOWN)
            .map(|(name, v)| format!("{name} {}", fmt_ms(*v)))
            .collect();
        let _ = writeln!(
            out,
            "  {}: largest phases, p50 ms: {}",
            label(row),
            shown.join(", ")
        );
    }
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
    phase_lines(s.rows.iter(), out);
}

/// The target column: PASS, MISS or "-".
fn verdict_cell(v: Option<f64>, pass: impl Fn(f64) -> bool) -> String {
    match v {
        Some(v) if pass(v) => "PASS".into(),
        Some(_) => "MISS".into(),
        None => "-".into(),
    }
}

fn render_arena(r: &Report, s: &Section, out: &mut String) {
    render_latency(
        s.rows.iter(),
        "mech",
        &[
            "target",
            "per-buffer p50",
            "per-buffer/ours",
            "PyTorch p50",
            "PyTorch/ours",
        ],
        series,
        |row| {
            let ours = row.p50();
            let per_buffer = r.p50(SectionId::Fresh, &row.series, None, row.size);
            let torch = r.p50(SectionId::Torch, "PyTorch", Some("fresh"), row.size);
            vec![
                verdict_cell(ours, |v| v <= targets::ARENA_P50_MS),
                opt_ms(per_buffer),
                ratio(per_buffer.zip(ours).map(|(p, o)| p / o)),
                opt_ms(torch),
                ratio(torch.zip(ours).map(|(t, o)| t / o)),
            ]
        },
        out,
    );
    phase_lines(s.rows.iter(), out);
}

fn render_push(r: &Report, s: &Section, out: &mut String) {
    let floor = targets::wake_floor_ms(r);
    render_latency(
        s.rows.iter(),
        "how",
        &[
            "target",
            "wake-up floor",
            "ours/floor",
            "PyTorch fresh p50",
            "PyTorch/ours",
        ],
        series,
        |row| {
            let ours = row.p50();
            let limit = targets::push_limit_ms(&row.series, floor);
            // PyTorch's own sharing of a fresh block of the same size (a
            // new tensor on a torch.multiprocessing queue), from the anchor.
            let torch = r.p50(SectionId::Torch, "PyTorch", Some("fresh"), row.size);
            vec![
                match limit {
                    Some(l) => verdict_cell(ours, |v| v <= l),
                    None => "-".into(),
                },
                opt_ms(floor),
                ratio(floor.zip(ours).map(|(f, o)| o / f)),
                opt_ms(torch),
                ratio(torch.zip(ours).map(|(t, o)| t / o)),
            ]
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
                    Some(v) if v <= targets::cached_limit(row.size.unwrap_or(0)) => "PASS".into(),
                    Some(_) => "MISS".into(),
                    None => "-".into(),
                },
                opt_ms(torch),
                ratio(torch.zip(ours).map(|(t, o)| t / o)),
            ]
        },
        out,
    );
    phase_lines(s.rows.iter(), out);
}

fn render_floor(s: &Section, out: &mut String) {
    let wake = |row: &&Row| row.series == super::WAKE_SERIES;
    render_latency(
        s.rows.iter().filter(|r| !wake(r)),
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
    render_latency(
        s.rows.iter().filter(wake),
        "wake-up",
        &["write p50"],
        label,
        |row| vec![opt_ms(row.part_p50("write"))],
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
    render_header(r, &mut out);
    render_sections(r, &mut out);
    render_targets(r, &mut out);
    out
}

/// The device, the run, the second GPU and where the consumers ran.
fn render_header(r: &Report, out: &mut String) {
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
    if !r.consumer_namespaces.is_empty() {
        let _ = writeln!(
            out,
            "consumers in new namespaces: {} ({})",
            r.consumer_namespaces.join(", "),
            r.consumer_command
        );
    }
    if let Some(m) = &r.mps {
        let driver = match m.driver_says_mps {
            Some(true) => "; the driver confirmed its processes went through MPS",
            Some(false) => "; the driver says its processes did NOT go through MPS",
            None => "",
        };
        let _ = writeln!(
            out,
            "MPS: every section ran twice, first without MPS, then under a private MPS control \
             daemon (pipe directory {}{driver}), marked \"under MPS\"; the targets use the runs \
             without MPS",
            m.pipe_directory
        );
        if let Some(e) = &m.error {
            let _ = writeln!(out, "MPS: FAILED: {e}");
        }
    }
    if r.awake_us > 0 {
        let _ = writeln!(
            out,
            "awake: the bench's processes polled up to {} us for each other's next message before \
             sleeping (CUDA_IPC_BENCH_AWAKE_US), so each sample found them awake; by default \
             they sleep between samples and every hand-off starts on idle virtual CPUs. Figures \
             of the two modes do not compare; the targets were set for the default",
            r.awake_us
        );
    }
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
}

/// Every section: its heading, its table and its notes.
fn render_sections(r: &Report, out: &mut String) {
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
            s.title(),
            s.seconds
        );
        if let Some(e) = &s.error {
            let _ = writeln!(out, "  FAILED: {e}");
        }
        match s.id {
            SectionId::Fresh => render_fresh(r, s, out),
            SectionId::Arena => render_arena(r, s, out),
            SectionId::Push => render_push(r, s, out),
            SectionId::Cached => render_cached(r, s, out),
            SectionId::Floor => render_floor(s, out),
            SectionId::Bandwidth => render_bandwidth(s, out),
            SectionId::Peer => render_peer(r, s, out),
            SectionId::Ring | SectionId::Sync => render_ring(s, out),
            SectionId::Scale => render_scale(s, out),
            SectionId::Sets => render_sets(r, s, out),
            SectionId::Torch => render_torch(s, out),
        }
        for note in &s.notes {
            let _ = writeln!(out, "  * {note}");
        }
    }
}

/// Every target and its verdict, then the summary line.
fn render_targets(r: &Report, out: &mut String) {
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
    t.render(out);
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
    if let Some(line) = super::targets::wake_floor_line(r) {
        let _ = writeln!(out, "{line}");
        if let Some(idle) = &r.idle {
            let _ = writeln!(out, "Idle processors here: {}.", idle.describe());
        }
    }
}
