//! The peer section (`--devices A,B`): hand-offs to a consumer on the
//! second GPU, copies between the two, and the floor across them.

use cuda_ipc::Mechanism;

use crate::report::{Row, Section, SectionId, human};

use super::bandwidth::{PEER_COPIES, copy_rows};
use super::cached::cached_row;
use super::floor::{FloorRig, floor_mechanisms, floor_row};
use super::fresh::fresh_row;
use super::{Consumer, Ctx, handoff_rows, skipped_rows};

/// The peer section (`--devices A,B`): fresh hand-offs from the producer
/// on GPU A to a consumer on GPU B, and B's copies out of a peer mapping
/// against cuMemcpyPeer between the same GPUs.
pub fn peer(ctx: &Ctx<'_>) -> Section {
    let floors = floor_mechanisms(ctx);
    let mechanisms = ctx.plan.mechanisms.len() as u64;
    let sizes = ctx.plan.sizes.len() as u64;
    let steps = mechanisms * (2 * sizes + 1) + floors.len() as u64 * sizes;
    let a = ctx.plan.device;
    let skip = |why: String| {
        (0..steps).for_each(|_| ctx.progress.done());
        Section::skipped(SectionId::Peer, why)
    };
    let Some(info) = &ctx.peer else {
        return skip("no second GPU: run with --devices A,B".into());
    };
    let b = info.device.ordinal;
    if !info.access_supported {
        return skip(format!(
            "GPU {b} cannot map GPU {a}'s memory (cuDeviceCanAccessPeer says no; link: {}): \
             buffers cannot be shared between these two GPUs without a copy through the host",
            info.link
        ));
    }
    let mut s = Section::new(SectionId::Peer);
    let mut consumer = Consumer::on(ctx, "the consumer on the second GPU", b);
    handoff_rows(
        ctx,
        &mut s,
        &mut consumer,
        None,
        &format!("GPU {a} -> GPU {b} fresh hand-off"),
        |w, m, size| fresh_row(ctx, w, m, size, ctx.plan.reps(size), "peer-fresh"),
    );
    handoff_rows(
        ctx,
        &mut s,
        &mut consumer,
        Some("cached"),
        &format!("GPU {a} -> GPU {b} cached hand-off"),
        |w, m, size| cached_row(ctx, w, m, size, ctx.plan.reps(size), "peer-cached"),
    );
    peer_floor_rows(ctx, &mut s, &floors, b);
    let size = ctx.plan.bandwidth_size;
    for &m in &ctx.plan.mechanisms {
        ctx.progress
            .step(&format!("GPU {a} -> GPU {b} copies, {m}, {}", human(size)));
        s.rows
            .extend(copy_rows(ctx, &mut consumer, m, &PEER_COPIES, Some(a)));
        ctx.progress.done();
    }
    let reps = ctx.plan.bandwidth_reps;
    s.notes = vec![
        format!(
            "Producer on GPU {a}, consumer on GPU {b} ({}; link {}). Hand-offs as in the fresh \
             hand-off section, the consumer's mapping a peer mapping: legacy handles opened with \
             LAZY_ENABLE_PEER_ACCESS, VMM and pool imports granted access for GPU {b}; the \
             consumer's stream on GPU {b} waits on the publish event recorded on GPU {a}. \
             Cached: as in the cached hand-off section, the update's event recorded on GPU {a} \
             and waited on by GPU {b}'s stream. same GPU = the fresh or cached hand-off \
             section's p50, both ends on GPU {a}.",
            info.device.name, info.link
        ),
        format!(
            "floor = the driver floor section's calls with the consumer on GPU {b} (a VMM mapping \
             granting GPU {b} and GPU {a} access in one cuMemSetAccess, as the library does)."
        ),
        format!(
            "Copies of {} on GPU {b}, each timed by a pair of CUDA events: from peer mapping = \
             the mapping of GPU {a}'s buffer -> a GPU {b} buffer; cuMemcpyPeer = a buffer the \
             consumer allocated on GPU {a} -> the same GPU {b} buffer, with peer access enabled \
             (cuCtxEnablePeerAccess), the driver's own peer copy; local = on GPU {b}; into peer \
             mapping = GPU {b} -> the mapping. GB/s counts bytes read plus written (2 x {}); {} \
             warm-up and {} kept copies of each kind, interleaved. The consumer checks the data \
             read through the mapping, and the producer's buffer after the writes into it.",
            human(size),
            human(size),
            reps.warmup,
            reps.reps
        ),
    ];
    s
}

/// The driver floor with its consumer on GPU `b`, for every floor
/// mechanism and size (a failure to set up fails the first row).
fn peer_floor_rows(ctx: &Ctx<'_>, s: &mut Section, floors: &[Mechanism], b: usize) {
    let rig = FloorRig::new(ctx, b).and_then(|rig| rig.consumer().map(|w| (rig, w)));
    let (rig, mut worker) = match rig {
        Ok(x) => x,
        Err(e) => {
            let mut e = Some(e.to_string());
            for &m in floors {
                for &size in &ctx.plan.sizes {
                    let row = Row::new(format!("{m} floor"), "ms").size(size);
                    s.rows.push(match e.take() {
                        Some(why) => row.failed(format!("setting up: {why}")),
                        None => row.skip("the floor's consumer did not start"),
                    });
                    ctx.progress.done();
                }
            }
            return;
        }
    };
    for &m in floors {
        if let Some(why) = ctx.unsupported(m) {
            let series = format!("{m} floor");
            skipped_rows(s, ctx, &series, &why, ctx.plan.sizes.len() as u64);
            continue;
        }
        for &size in &ctx.plan.sizes {
            ctx.progress.step(&format!(
                "GPU {} -> GPU {b} driver floor, {m}, {}",
                ctx.plan.device,
                human(size)
            ));
            s.rows.push(floor_row(ctx, &mut worker, &rig, m, size));
            ctx.progress.done();
        }
    }
    worker.close();
}
