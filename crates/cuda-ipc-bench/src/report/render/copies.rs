//! The tables of the copy bandwidths: the bandwidth section (copies
//! through a mapping on one GPU) and the peer section (between two GPUs).

use std::fmt::Write as _;

use super::super::format::human;
use super::super::model::{Report, Row, Section, SectionId};
use super::{Table, against, label, n, opt_ms, problem, problem_line, render_latency, series};

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

pub(super) fn render_bandwidth(s: &Section, out: &mut String) {
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
pub(super) fn render_peer(r: &Report, s: &Section, out: &mut String) {
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
