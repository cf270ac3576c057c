//! Section 4: bandwidth through a mapping against local copies.

use cuda_ipc::{Dtype, Error, Mechanism};
use serde_json::{Value, json};

use crate::proto::{REQUEST_TIMEOUT, get_f64s};
use crate::report::{Row, Section, SectionId, human};
use crate::stats::gb_per_s;

use super::{Consumer, Ctx, UNPUBLISH_TIMEOUT, filled, pattern, tag};

/// The copies of section 4 the consumer times, by row variant.
pub(super) const COPIES: [&str; 3] = ["from_mapping", "local", "into_mapping"];
/// The copies of the peer section: section 4's and cuMemcpyPeer.
pub(super) const PEER_COPIES: [&str; 4] = ["from_mapping", "memcpy_peer", "local", "into_mapping"];

/// One row per copy in `kinds` for mechanism `m`: a buffer of the
/// bandwidth size is published, and consumer `c` times copies out of its
/// mapping, local copies and copies into the mapping (and, with
/// `peer_of`, cuMemcpyPeer from a buffer of its own on that GPU), checking
/// the data both ways.
pub(super) fn copy_rows(
    ctx: &Ctx<'_>,
    consumer: &mut Consumer,
    m: Mechanism,
    kinds: &[&str],
    peer_of: Option<usize>,
) -> Vec<Row> {
    let size = ctx.plan.bandwidth_size;
    let reps = ctx.plan.bandwidth_reps;
    let row = |kind: &str| Row::new(m.name(), "GB/s").variant(kind).size(size);
    if let Some(why) = ctx.unsupported(m) {
        return vec![row(kinds[0]).skip(why)];
    }
    let name = format!(
        "{}/{m}",
        if peer_of.is_some() {
            "peer"
        } else {
            "bandwidth"
        }
    );
    let written = pattern(tag(m, size), 0);
    let measured = (|| -> Result<Value, Error> {
        let w = consumer.get()?;
        let buffer = filled(ctx, m, size, written)?;
        let published = ctx.publisher.publish(&name, buffer, Dtype::U32, None)?;
        let mut request = json!({
            "op": "bandwidth", "name": name, "warmup": reps.warmup, "reps": reps.reps,
            "base": written.base, "step": written.step,
        });
        if let Some(d) = peer_of {
            request["peer_device"] = d.into();
        }
        let a = w.request(&request, REQUEST_TIMEOUT);
        let gone = ctx.publisher.unpublish(&name, Some(UNPUBLISH_TIMEOUT));
        drop(published);
        let a = a?;
        gone?;
        Ok(a)
    })();
    match measured {
        Ok(answer) => kinds
            .iter()
            .map(|kind| match get_f64s(&answer, &format!("{kind}_ms")) {
                Ok(ms) => row(kind).samples(
                    reps.warmup,
                    ms.iter().map(|ms| gb_per_s(2 * size, *ms)).collect(),
                ),
                Err(e) => row(kind).failed(e.to_string()),
            })
            .collect(),
        Err(e) => vec![row(kinds[0]).failed(e.to_string())],
    }
}

/// Section 4: bandwidth through a mapping.
pub fn bandwidth(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Bandwidth);
    let size = ctx.plan.bandwidth_size;
    let reps = ctx.plan.bandwidth_reps;
    let mut c = Consumer::new(ctx, "the bandwidth consumer");
    for &m in &ctx.plan.mechanisms {
        ctx.progress
            .step(&format!("bandwidth, {m}, {}", human(size)));
        s.rows.extend(copy_rows(ctx, &mut c, m, &COPIES, None));
        ctx.progress.done();
    }
    s.notes = vec![
        format!(
            "In the consumer: device-to-device copies of {} (cuMemcpyDtoDAsync), each timed by a \
             pair of CUDA events (cuEventElapsedTime); GB/s counts bytes read plus bytes written \
             (2 x {}). {} warm-up and {} kept copies of each kind, interleaved.",
            human(size),
            human(size),
            reps.warmup,
            reps.reps
        ),
        format!(
            "from mapping = mapping -> local buffer; local = local -> local; into mapping = local \
             -> mapping. Target: from/local >= {:.2}.",
            crate::report::targets::BANDWIDTH_RATIO
        ),
    ];
    s
}
