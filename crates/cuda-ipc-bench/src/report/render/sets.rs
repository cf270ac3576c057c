//! The table of the weight sets section: per set, ours from Rust, from
//! Python, PyTorch's; then the model of the first attach and its load.

use super::super::format::{fmt_ms, human};
use super::super::model::{Report, Row, Section, SectionId};
use super::super::targets;
use super::{Table, label, n, problem_line, ratio, stat, verdict_cell};

/// A byte count for the extra-memory column.
fn bytes(b: Option<u64>) -> String {
    b.map_or_else(
        || "-".into(),
        |b| if b == 0 { "0".into() } else { human(b) },
    )
}

/// A set's size: in binary units when whole MiB (the drawn sets), else in
/// decimal GB (a model's).
fn set_size(b: u64) -> String {
    if b.is_multiple_of(1 << 20) {
        human(b)
    } else {
        format!("{:.2}GB", b as f64 / 1e9)
    }
}

/// The target cell of a row of the sets section (a set of `count`
/// tensors): PASS or MISS where a target holds its p50, else empty.
fn set_target_cell(row: &Row, count: u64) -> String {
    use targets::{PY_SERIES, SET_HUGE, SET_LARGE, SET_SMALL};
    let limit = match (row.series.as_str(), row.variant.as_deref(), count) {
        ("ours", Some("set"), SET_SMALL) => targets::SET_SMALL_P50_MS,
        ("ours", Some("set"), SET_LARGE) => targets::SET_LARGE_P50_MS,
        ("ours", Some("update"), _) => targets::SET_UPDATE_P50_MS,
        (PY_SERIES, Some("set"), SET_LARGE) => targets::PY_SET_LARGE_P50_MS,
        (PY_SERIES, Some("set"), SET_HUGE) => targets::PY_SET_HUGE_P50_MS,
        (PY_SERIES, Some("update"), SET_LARGE) => targets::PY_UPDATE_P50_MS,
        (PY_SERIES, Some(targets::FIRST_ATTACH), _) => targets::FIRST_ATTACH_P50_MS,
        _ => return String::new(),
    };
    verdict_cell(row.p50(), |v| v <= limit)
}

pub(super) fn render_sets(r: &Report, s: &Section, out: &mut String) {
    // The drawn sets by size, then the model of the first attach.
    let is_model = |c: u64| {
        s.rows.iter().any(|row| {
            row.count == Some(c)
                && matches!(
                    row.variant.as_deref(),
                    Some(targets::FIRST_ATTACH | targets::LOAD_FILE)
                )
        })
    };
    let mut counts: Vec<u64> = s.rows.iter().filter_map(|row| row.count).collect();
    counts.sort_unstable_by_key(|c| (is_model(*c), *c));
    counts.dedup();
    let order = [
        "set",
        "update",
        "list",
        "bucket",
        targets::FIRST_ATTACH,
        targets::LOAD_FILE,
    ];
    let rank = |row: &Row| {
        let v = row.variant.as_deref().unwrap_or("");
        order.iter().position(|o| *o == v).unwrap_or(order.len())
    };
    let mut t = Table::new(&[
        "contender",
        "tensors",
        "size",
        "n",
        "p50",
        "p90",
        "p99",
        "extra",
        "target",
        "it/ours",
    ])
    .left_aligned(1);
    for count in counts {
        let mut rows: Vec<&Row> = s
            .rows
            .iter()
            .filter(|row| row.count == Some(count))
            .collect();
        rows.sort_by_key(|row| rank(row));
        for row in rows {
            if problem_line(&mut t, row, &label(row)) {
                continue;
            }
            let p50 = row.p50();
            // it/ours: an update against ours from Rust's update, the
            // model's load against its first attach, the rest against ours
            // from Rust's set
            let (series, variant) = match (row.series.as_str(), row.variant.as_deref()) {
                ("ours", _) | (targets::PY_SERIES, Some(targets::FIRST_ATTACH)) => ("", ""),
                (_, Some("update")) => ("ours", "update"),
                (_, Some(targets::LOAD_FILE)) => (targets::PY_SERIES, targets::FIRST_ATTACH),
                _ => ("ours", "set"),
            };
            let is_ours = series.is_empty();
            let ours = r
                .row_of_count(SectionId::Sets, series, variant, count)
                .and_then(Row::p50);
            let target = set_target_cell(row, count);
            t.row(vec![
                format!("{} {}", row.series, row.variant.as_deref().unwrap_or("")),
                count.to_string(),
                row.size.map_or_else(|| "-".into(), set_size),
                n(row),
                stat(row, |s| s.p50),
                stat(row, |s| s.p90),
                stat(row, |s| s.p99),
                bytes(row.extra_device_bytes),
                target,
                if is_ours {
                    String::new()
                } else {
                    ratio(p50.zip(ours).map(|(t, o)| t / o))
                },
            ]);
            if let Some(line) = first_attach_parts(row)
                .or_else(|| update_part(row))
                .or_else(|| handoff_parts(row))
            {
                t.line(line);
            }
            if let Some(line) = collector_part(row) {
                t.line(line);
            }
        }
    }
    if !s.rows.is_empty() {
        t.render(out);
    }
}

/// The producer's own call in an update row (its part `update`: from
/// Rust `Publisher::update_set`, from Python `update_state_dict`), as a
/// line under it: what an update costs the publisher at each set size,
/// apart from the consumer's wait.
fn update_part(row: &Row) -> Option<String> {
    if row.variant.as_deref() != Some("update") {
        return None;
    }
    let call = match row.series.as_str() {
        "ours" => "Publisher::update_set",
        targets::PY_SERIES => "Publisher.update_state_dict",
        _ => return None,
    };
    let s = row.parts.get("update")?;
    Some(format!(
        "  the producer's {call}: p50 {} ms, p99 {} ms",
        fmt_ms(s.p50),
        fmt_ms(s.p99)
    ))
}

/// The parts of a hand-off row of ours (Rust or Python) that were
/// measured, p50, as a line under it: the producer's call, the request's
/// way to the consumer, the consumer's work and, from Python, that work
/// split into the Rust attach and the tensors.
fn handoff_parts(row: &Row) -> Option<String> {
    const NAMES: [(&str, &str); 6] = [
        ("publish", "publish"),
        ("request", "request"),
        ("consumer", "consumer"),
        ("attach_set", "of which attach_set"),
        ("tensors", "tensors"),
        ("teardown", "unpublish"),
    ];
    if row.series != "ours" && row.series != targets::PY_SERIES {
        return None;
    }
    let shown: Vec<String> = NAMES
        .iter()
        .filter_map(|(key, label)| {
            row.part_p50(key)
                .map(|v| format!("{label} {} ms", fmt_ms(v)))
        })
        .collect();
    (!shown.is_empty()).then(|| format!("  p50 parts: {}", shown.join(", ")))
}

/// Python's cycle collector inside a Python row's clock (its parts `gc`
/// and `gc_full`, both processes), as a line under it where it ran in any
/// kept sample: the p99 a full collection makes.
fn collector_part(row: &Row) -> Option<String> {
    if row.series != targets::PY_SERIES {
        return None;
    }
    let all = row.parts.get("gc")?;
    if all.max <= 0.0 {
        return None;
    }
    let full = row
        .parts
        .get("gc_full")
        .filter(|f| f.max > 0.0)
        .map(|f| {
            format!(
                "; full collections p99 {} ms, largest {} ms",
                fmt_ms(f.p99),
                fmt_ms(f.max)
            )
        })
        .unwrap_or_default();
    Some(format!(
        "  Python's cycle collector inside the clock: p50 {} ms, p99 {} ms, largest {} ms{full}",
        fmt_ms(all.p50),
        fmt_ms(all.p99),
        fmt_ms(all.max)
    ))
}

/// The parts of a first attach row, as a line under it.
fn first_attach_parts(row: &Row) -> Option<String> {
    if row.series != targets::PY_SERIES || row.variant.as_deref() != Some(targets::FIRST_ATTACH) {
        return None;
    }
    let p = |k| row.part_p50(k).map(fmt_ms);
    Some(format!(
        "  p50 parts: Subscriber {} ms, attach_state_dict {} ms; process start to tensors usable \
         {} ms (of which Python, imports and CUDA {} ms)",
        p("connect")?,
        p("attach")?,
        p("start_to_usable")?,
        p("startup")?
    ))
}
