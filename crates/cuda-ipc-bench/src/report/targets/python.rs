//! The targets of ours from Python (rows of the sets section in
//! [`PY_SERIES`]): the weight sets from `bench/cuda_ipc_share.py` against
//! the same sets from Rust and PyTorch's, their update, and a fresh
//! process's first attach of a model from `bench/first_attach.py` against
//! safetensors' load of it.

use super::super::format::{fmt_ms, human};
use super::super::model::{Report, Row, Section, TargetCheck};
use super::{
    FIRST_ATTACH, LOAD_FILE, PY_SERIES, SAFETENSORS_SERIES, SET_LARGE, check, torch_missing,
    why_missing,
};

/// The large weight set from Python (`publish_state_dict` →
/// `attach_state_dict`), median, ms.
pub const PY_SET_LARGE_P50_MS: f64 = 1.5;
/// Its 99th percentile, ms.
pub const PY_SET_LARGE_P99_MS: f64 = 3.0;
/// The large weight set from Python p50 / the same set from Rust.
pub const PY_RUST_RATIO: f64 = 1.25;
/// PyTorch's list of tensors p50 / ours from Python, large set.
pub const PY_LIST_SPEEDUP: f64 = 30.0;
/// PyTorch's flattened bucket p50 / ours from Python, large set.
pub const PY_BUCKET_SPEEDUP: f64 = 2.0;
/// The largest weight set's tensors.
pub const SET_HUGE: u64 = 10_000;
/// Its hand-off from Python, median, ms.
pub const PY_SET_HUGE_P50_MS: f64 = 12.0;
/// `update_state_dict` → `wait_update` from Python, large set, median, ms.
pub const PY_UPDATE_P50_MS: f64 = 0.05;
/// A fresh process's `Subscriber` + `attach_state_dict` of the model,
/// median, ms.
pub const FIRST_ATTACH_P50_MS: f64 = 3.0;
/// safetensors' `load_file` of the same model from the page cache p50 /
/// the first attach p50.
pub const SAFETENSORS_SPEEDUP: f64 = 300.0;

/// The figure of a row that neither failed nor was skipped.
fn usable(row: Option<&Row>) -> Option<&Row> {
    row.filter(|x| x.error.is_none() && x.skipped.is_none())
}

fn p50(row: Option<&Row>) -> Option<f64> {
    usable(row).and_then(Row::p50)
}

fn p99(row: Option<&Row>) -> Option<f64> {
    usable(row).and_then(|x| x.stats.as_ref()).map(|s| s.p99)
}

fn ms(v: f64) -> String {
    format!("{} ms", fmt_ms(v))
}

fn times(v: f64) -> String {
    format!("{v:.1}x")
}

/// Why a ratio of `num` over `den` has no figure: the first of them that
/// has none.
fn why_ratio(num: Option<&Row>, den: Option<&Row>) -> &'static str {
    if p50(num).is_none() {
        why_missing(num)
    } else {
        why_missing(den)
    }
}

/// The rows of section `s`, found by series, variant and (if given) count.
struct Rows<'a>(&'a Section);

impl<'a> Rows<'a> {
    fn find(&self, series: &str, variant: &str, count: Option<u64>) -> Option<&'a Row> {
        self.0.rows.iter().find(|row| {
            row.series == series
                && row.variant.as_deref() == Some(variant)
                && count.is_none_or(|c| row.count == Some(c))
        })
    }

    /// Whether the section has rows of `count` tensors (the plan drew that set).
    fn has(&self, count: u64) -> bool {
        self.0.rows.iter().any(|row| row.count == Some(count))
    }

    /// The total size of the set of `count` tensors, as printed.
    fn total(&self, count: u64) -> String {
        self.0
            .rows
            .iter()
            .find(|row| row.count == Some(count) && row.size.is_some())
            .and_then(|row| row.size)
            .map_or_else(|| "?".into(), human)
    }
}

/// The large set from Python: its p50 and p99, against the Rust row and
/// PyTorch's list and bucket; its update.
fn large_set(r: &Report, rows: &Rows<'_>, out: &mut Vec<TargetCheck>) {
    let count = SET_LARGE;
    let total = rows.total(count);
    let py_row = rows.find(PY_SERIES, "set", Some(count));
    let py = p50(py_row);
    out.push(check(
        format!("python-set/{count}"),
        format!("weight set from Python p50, {count} tensors / {total}"),
        format!("<= {PY_SET_LARGE_P50_MS:.1} ms"),
        py,
        ms,
        |v| v <= PY_SET_LARGE_P50_MS,
        why_missing(py_row),
    ));
    out.push(check(
        format!("python-set-p99/{count}"),
        format!("weight set from Python p99, {count} tensors / {total}"),
        format!("<= {PY_SET_LARGE_P99_MS:.1} ms"),
        p99(py_row),
        ms,
        |v| v <= PY_SET_LARGE_P99_MS,
        why_missing(py_row),
    ));
    let rust_row = rows.find("ours", "set", Some(count));
    out.push(check(
        format!("python/rust/{count}"),
        format!("weight set, {count} tensors: from Python p50 / from Rust p50"),
        format!("<= {PY_RUST_RATIO:.2}x"),
        py.zip(p50(rust_row)).map(|(p, o)| p / o),
        |v| format!("{v:.2}x"),
        |v| v <= PY_RUST_RATIO,
        why_ratio(py_row, rust_row),
    ));
    for (variant, goal) in [("list", PY_LIST_SPEEDUP), ("bucket", PY_BUCKET_SPEEDUP)] {
        let torch_row = rows.find("PyTorch", variant, Some(count));
        out.push(check(
            format!("python-{variant}/{count}"),
            format!("weight set, {count} tensors: PyTorch {variant} p50 / ours from Python p50"),
            format!(">= {goal:.0}x"),
            p50(torch_row).zip(py).map(|(t, p)| t / p),
            times,
            |v| v >= goal,
            if py.is_none() {
                why_missing(py_row)
            } else if torch_row.is_some_and(|t| t.error.is_some()) {
                "failed"
            } else {
                torch_missing(r)
            },
        ));
    }
    let update = rows.find(PY_SERIES, "update", Some(count));
    out.push(check(
        format!("python-update/{count}"),
        format!("update_state_dict -> wait_update from Python p50, {count} tensors"),
        format!("<= {PY_UPDATE_P50_MS:.3} ms"),
        p50(update),
        ms,
        |v| v <= PY_UPDATE_P50_MS,
        why_missing(update),
    ));
}

/// A fresh process's first attach of the model, and safetensors' load of
/// it over that.
fn first_attach(rows: &Rows<'_>, out: &mut Vec<TargetCheck>) {
    let ours = rows.find(PY_SERIES, FIRST_ATTACH, None);
    let load = rows.find(SAFETENSORS_SERIES, LOAD_FILE, None);
    let model = ours
        .or(load)
        .and_then(|row| row.size)
        .map_or_else(String::new, |b| format!(", {:.1} GB model", b as f64 / 1e9));
    out.push(check(
        "first-attach".into(),
        format!("first attach in a new process (Subscriber + attach_state_dict) p50{model}"),
        format!("<= {FIRST_ATTACH_P50_MS:.1} ms"),
        p50(ours),
        ms,
        |v| v <= FIRST_ATTACH_P50_MS,
        why_missing(ours),
    ));
    out.push(check(
        "first-attach-safetensors".into(),
        format!("first attach{model}: safetensors load_file from the page cache p50 / ours p50"),
        format!(">= {SAFETENSORS_SPEEDUP:.0}x"),
        p50(load).zip(p50(ours)).map(|(l, o)| l / o),
        |v| format!("{v:.0}x"),
        |v| v >= SAFETENSORS_SPEEDUP,
        why_ratio(ours, load),
    ));
}

/// Every target of ours from Python in the sets section `s` of `r`: those
/// of a set when the plan drew it, those of the first attach when its rows
/// are there (measured, failed or skipped).
pub(super) fn targets(r: &Report, s: &Section, out: &mut Vec<TargetCheck>) {
    let rows = Rows(s);
    if rows.has(SET_LARGE) {
        large_set(r, &rows, out);
    }
    if rows.has(SET_HUGE) {
        let count = SET_HUGE;
        let py_row = rows.find(PY_SERIES, "set", Some(count));
        out.push(check(
            format!("python-set/{count}"),
            format!(
                "weight set from Python p50, {count} tensors / {}",
                rows.total(count)
            ),
            format!("<= {PY_SET_HUGE_P50_MS:.0} ms"),
            p50(py_row),
            ms,
            |v| v <= PY_SET_HUGE_P50_MS,
            why_missing(py_row),
        ));
    }
    if rows.find(PY_SERIES, FIRST_ATTACH, None).is_some()
        || rows.find(SAFETENSORS_SERIES, LOAD_FILE, None).is_some()
    {
        first_attach(&rows, out);
    }
}
