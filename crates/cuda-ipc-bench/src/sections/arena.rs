//! Fresh hand-offs from an arena: a new buffer each sample, allocated from
//! the arena of a publisher ([`Sharing::Arena`]) whose chunks were exported
//! once, before the clock.

use cuda_ipc::exchange::{Endpoint, Publisher, PublisherConfig, Sharing};
use cuda_ipc::kernels::{self, Speed};
use cuda_ipc::{DeviceMemory, Dtype, Error, Mechanism};
use serde_json::json;

use crate::Reps;
use crate::proto::{REQUEST_TIMEOUT, failure, get_u64, mono_ns};
use crate::report::{Row, Section, SectionId, human};
use crate::stats::ns_to_ms;

use super::phase_parts::PhaseParts;
use super::{Consumer, Ctx, UNPUBLISH_TIMEOUT, pattern, tag};

/// A publisher whose buffers come from an arena of `m` chunks, on a socket
/// of its own (`what` names it).
pub(super) fn arena_publisher(ctx: &Ctx<'_>, m: Mechanism, what: &str) -> Result<Publisher, Error> {
    Publisher::bind(
        ctx.device,
        Endpoint::Name(format!("bench-{what}-{m}-{}", std::process::id())),
        PublisherConfig::default().with_sharing(Sharing::arena(m)),
    )
    .map_err(|e| {
        failure(
            format!("starting a publisher with an arena of {m} chunks"),
            e,
        )
    })
}

/// Makes and exports the arena's chunk for buffers of `size` bytes (of
/// `m` chunks) before the clock.
pub(super) fn reserve(publisher: &Publisher, m: Mechanism, size: u64) -> Result<(), Error> {
    publisher
        .arena()?
        .reserve(size)
        .map_err(|e| failure(format!("reserving {} of {m} chunks", human(size)), e))?;
    Ok(())
}

/// A new buffer of `size` bytes from `publisher`'s arena, filled with
/// `pat` and finished (not timed).
pub(super) fn filled_buffer(
    publisher: &Publisher,
    size: u64,
    pat: kernels::Pattern,
) -> Result<cuda_ipc::arena::DeviceArenaBuffer, Error> {
    let buffer = publisher.alloc(size)?;
    kernels::fill_u32(&buffer, pat, Speed::Full)?;
    buffer.synchronize()?;
    Ok(buffer)
}

/// A row of fresh hand-offs of `size` bytes from `publisher`'s arena (of
/// `m` chunks) to consumer `c`: each sample a new buffer of the arena (no
/// export), filled and finished, then timed from `publish_buffer` to the
/// consumer's synchronised buffer.
fn arena_row(publisher: &Publisher, c: &mut Consumer, m: Mechanism, size: u64, reps: Reps) -> Row {
    let row = Row::new(m.name(), "ms").size(size);
    let worker = match c.get() {
        Ok(worker) => worker,
        Err(e) => return row.failed(e.to_string()),
    };
    let (mut total, mut publish, mut consumer, mut verify, mut teardown) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut phases = PhaseParts::default();
    let seed = tag(m, size) ^ 0xA4E7;
    let measured = (|| -> Result<(), Error> {
        // The chunk is made and exported now, not on the hand-off path.
        reserve(publisher, m, size)?;
        for i in 0..reps.total() {
            let pat = pattern(seed, i);
            let buffer = filled_buffer(publisher, size, pat)?;
            let name = format!("arena/{m}/{size}/{i}");
            let request =
                json!({ "op": "attach", "name": name, "base": pat.base, "step": pat.step });
            let t0 = mono_ns();
            publisher.publish_buffer(&name, &buffer, Dtype::U32, &[size / 4])?;
            let t_pub = mono_ns();
            let answer = worker
                .send(&request)
                .and_then(|()| worker.recv(REQUEST_TIMEOUT));
            // Read once the consumer has answered, outside its clock.
            let publish_phases = cuda_ipc::phases::last("core.publish_set");
            let t = std::time::Instant::now();
            let unpublished = publisher.unpublish_set(&name, Some(UNPUBLISH_TIMEOUT));
            drop(buffer);
            let teardown_ms = t.elapsed().as_secs_f64() * 1e3;
            let answer = answer.map_err(|e| failure(format!("sample {i}"), e))?;
            unpublished.map_err(|e| failure(format!("sample {i}: unpublishing"), e))?;
            if i < reps.warmup {
                continue;
            }
            let (t_recv, t_done) = (get_u64(&answer, "t_recv")?, get_u64(&answer, "t_done")?);
            total.push(ns_to_ms(t0, t_done));
            publish.push(ns_to_ms(t0, t_pub));
            consumer.push(ns_to_ms(t_recv, t_done));
            verify.push(answer["verify_ms"].as_f64().unwrap_or(f64::NAN));
            teardown.push(teardown_ms);
            phases.add("publish", &publish_phases);
            phases.add_json("attach", &answer["phases"]);
        }
        Ok(())
    })();
    let row = row
        .samples(reps.warmup, total)
        .part("publish", &publish)
        .part("consumer", &consumer)
        .part("verify", &verify)
        .part("teardown", &teardown);
    let row = phases.into_row(row);
    match measured {
        Ok(()) => row,
        Err(e) => row.failed(e.to_string()),
    }
}

/// The arena section: one row per mechanism and size up to 1 GiB, each
/// mechanism with a publisher (and a consumer) of its own.
pub fn arena(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Arena);
    for &m in &ctx.plan.mechanisms {
        let sizes = &ctx.plan.arena_sizes;
        // Rows that cannot be measured: skipped (the device lacks the
        // mechanism) or failed (no publisher).
        let unmeasured = |s: &mut Section, mark: &dyn Fn(Row) -> Row| {
            for &size in sizes {
                s.rows.push(mark(Row::new(m.name(), "ms").size(size)));
                ctx.progress.done();
            }
        };
        if let Some(why) = ctx.unsupported(m) {
            unmeasured(&mut s, &|row| row.skip(why.clone()));
            continue;
        }
        let publisher = match arena_publisher(ctx, m, "arena") {
            Ok(p) => p,
            Err(e) => {
                unmeasured(&mut s, &|row| row.failed(e.to_string()));
                continue;
            }
        };
        let mut c = Consumer::of(ctx, "the arena hand-off's consumer", publisher.path());
        for &size in sizes {
            ctx.progress.step(&format!(
                "fresh hand-off from an arena, {m}, {}",
                human(size)
            ));
            s.rows
                .push(arena_row(&publisher, &mut c, m, size, ctx.plan.reps(size)));
            ctx.progress.done();
        }
        // The consumer exits (and unmaps) before the chunks are freed.
        drop(c);
        drop(publisher);
    }
    s.notes = notes();
    s
}

/// What the section's figures include.
pub(crate) fn notes() -> Vec<String> {
    vec![
        "One way, as the fresh hand-off: the producer's clock just before \
         Publisher::publish_buffer of a new buffer of its arena (Publisher::alloc, filled and \
         finished before the clock) to the consumer's after Subscriber::attach returned and \
         synchronize() on the buffer completed. The arena's chunk was made and exported before \
         the first sample (Arena::reserve); the consumer mapped it on the first sample (a \
         warm-up sample) and keeps the mapping in its cache: per sample there is no driver \
         export and no import, only one event record, one message with the set record of one \
         entry, and the attach over the channel."
            .into(),
        "Parts 'publish: PHASE' are Publisher::publish_buffer's phases by its own clock (the \
         record, the leases, the event, the fence, its encoding, the book and the message); \
         'attach: PHASE' are the consumer's Subscriber::attach (the request's round trip, the \
         record's decoding, the event or fence, the cached mapping, the stream's wait, the \
         view) and its synchronize(). Between 'publish' and 'consumer' lies the bench's own \
         request to its consumer process."
            .into(),
        "Not included: allocating and filling the buffer, the consumer's check of 8 words, the \
         release, Publisher::unpublish_set (teardown). Columns: per-buffer p50 = the fresh \
         section's row of the same mechanism and size (a new export every sample); PyTorch \
         p50 = its fresh hand-off of the same size in this run."
            .into(),
        format!(
            "Targets: p50 <= {:.3} ms at every size from 2 MiB to 1 GiB, and PyTorch's fresh \
             hand-off p50 / ours >= {:.0}x.",
            crate::report::targets::ARENA_P50_MS,
            crate::report::targets::ARENA_TORCH_SPEEDUP
        ),
    ]
}
