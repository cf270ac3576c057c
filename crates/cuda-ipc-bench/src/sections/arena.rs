//! Fresh hand-offs from an arena: a new buffer each sample, sub-allocated
//! from an arena whose chunks were exported once, before the clock.

use cuda_ipc::arena::{Arena, ArenaOptions, DeviceArena, DeviceChunks, SetMember};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::set::SetRecord;
use cuda_ipc::{DeviceMemory, Dtype, Error, IpcEvent, Mechanism, share};
use serde_json::{Value, json};

use crate::Reps;
use crate::proto::{REQUEST_TIMEOUT, Worker, failure, get_u64, mono_ns};
use crate::report::{Row, Section, SectionId, human};
use crate::stats::ns_to_ms;

use super::{Consumer, Ctx, pattern, tag};

const MIB: u64 = 1 << 20;

/// An arena of `m` chunks of at least `chunk_size` bytes, with `reserve`
/// bytes of chunks made (and exported) now.
pub(super) fn new_arena(
    ctx: &Ctx<'_>,
    m: Mechanism,
    chunk_size: u64,
    reserve: u64,
) -> Result<DeviceArena, Error> {
    let options = ArenaOptions {
        chunk_size: chunk_size.max(2 * MIB),
        max_chunk_size: chunk_size.max(ArenaOptions::default().max_chunk_size),
        ..ArenaOptions::default()
    };
    // The consumer takes the chunks' file descriptors with pidfd_getfd.
    share::allow_fd_fetching()?;
    let arena = Arena::new(DeviceChunks::new(ctx.device, Some(m))?, options)
        .map_err(|e| failure(format!("making an arena of {m} chunks"), e))?;
    arena
        .reserve(reserve)
        .map_err(|e| failure(format!("reserving {} of {m} chunks", human(reserve)), e))?;
    Ok(arena)
}

/// The hand-off of a set record: the producer's event recorded, the
/// record made and sent to the consumer, which maps what it has not mapped
/// yet, waits on the event and synchronises. `(t0, t_pub)` and the answer.
pub(super) fn send_set<'a>(
    ctx: &Ctx<'_>,
    w: &mut Worker,
    (arena, event): (&DeviceArena, &IpcEvent),
    name: &str,
    members: impl IntoIterator<Item = SetMember<'a>>,
    p: Pattern,
    hold: bool,
) -> Result<(u64, u64, Value), Error> {
    let t0 = mono_ns();
    event.record(ctx.device.stream())?;
    let mut record: SetRecord = arena.describe_set(name, members)?;
    record.event = Some(event.handle()?);
    let request = json!({
        "op": "set_attach",
        "set": record.to_value(),
        "base": p.base,
        "step": p.step,
        "hold": hold,
    });
    let t_pub = mono_ns();
    let answer = w.request(&request, REQUEST_TIMEOUT)?;
    Ok((t0, t_pub, answer))
}

/// A row of fresh hand-offs of `size` bytes from an arena of `m` chunks to
/// consumer `c`: each sample a new buffer of the arena (no export), filled
/// and finished, then timed from the producer's event record to the
/// consumer's synchronised view.
fn arena_row(ctx: &Ctx<'_>, c: &mut Consumer, m: Mechanism, size: u64, reps: Reps) -> Row {
    let row = Row::new(m.name(), "ms").size(size);
    let worker = match c.get() {
        Ok(worker) => worker,
        Err(e) => return row.failed(e.to_string()),
    };
    let (mut total, mut publish, mut consumer, mut verify) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let seed = tag(m, size) ^ 0xA4E7;
    let made = new_arena(ctx, m, size, size).and_then(|a| Ok((a, IpcEvent::new(ctx.device)?)));
    let (arena, event) = match made {
        Ok(x) => x,
        Err(e) => return row.failed(e.to_string()),
    };
    let measured = (|| -> Result<(), Error> {
        for i in 0..reps.total() {
            let pat = pattern(seed, i);
            let buffer = arena.alloc(size)?;
            kernels::fill_u32(&buffer, pat, Speed::Full)?;
            buffer.synchronize()?;
            let member = SetMember {
                name: "buffer",
                dtype: Dtype::U32,
                shape: &[size / 4],
                buffer: &buffer,
            };
            let name = format!("arena/{m}/{size}/{i}");
            let (t0, t_pub, answer) =
                send_set(ctx, worker, (&arena, &event), &name, [member], pat, false)
                    .map_err(|e| failure(format!("sample {i}"), e))?;
            drop(buffer);
            if i < reps.warmup {
                continue;
            }
            let (t_recv, t_done) = (get_u64(&answer, "t_recv")?, get_u64(&answer, "t_done")?);
            total.push(ns_to_ms(t0, t_done));
            publish.push(ns_to_ms(t0, t_pub));
            consumer.push(ns_to_ms(t_recv, t_done));
            verify.push(answer["verify_ms"].as_f64().unwrap_or(f64::NAN));
        }
        Ok(())
    })();
    // The consumer unmaps (also after a failed sample) before the arena's
    // chunks are freed.
    let closed = worker.request(&json!({ "op": "chunks_close" }), REQUEST_TIMEOUT);
    drop(arena);
    let measured = measured.and(closed.map(drop));
    let row = row
        .samples(reps.warmup, total)
        .part("publish", &publish)
        .part("consumer", &consumer)
        .part("verify", &verify);
    match measured {
        Ok(()) => row,
        Err(e) => row.failed(e.to_string()),
    }
}

/// The arena section: one row per mechanism and size up to 1 GiB.
pub fn arena(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Arena);
    let mut c = Consumer::new(ctx, "the arena hand-off's consumer");
    for &m in &ctx.plan.mechanisms {
        let unsupported = ctx.unsupported(m);
        for &size in &ctx.plan.arena_sizes {
            if let Some(why) = unsupported.clone() {
                s.rows.push(Row::new(m.name(), "ms").size(size).skip(why));
                ctx.progress.done();
                continue;
            }
            ctx.progress.step(&format!(
                "fresh hand-off from an arena, {m}, {}",
                human(size)
            ));
            s.rows
                .push(arena_row(ctx, &mut c, m, size, ctx.plan.reps(size)));
            ctx.progress.done();
        }
    }
    s.notes = notes();
    s
}

/// What the section's figures include.
pub(crate) fn notes() -> Vec<String> {
    vec![
        "One way, as the fresh hand-off: the producer's clock just before it hands off a new \
         buffer of an arena (its event record, the set record of one entry made and sent) to \
         the consumer's after it holds a view of the buffer synchronised. The arena's chunk \
         was created and exported before the first sample (Arena::reserve), and the consumer \
         mapped it on the first sample (a warm-up sample, the mapping cached by chunk id): \
         per sample there is no driver export and no import, only an offset, one event record \
         and one message."
            .into(),
        "The message is the set record as one JSON line over the consumer's pipe (the \
         library's exchange has no arena hand-off yet); the consumer takes the chunk's file \
         descriptor with pidfd_getfd on its first mapping. publish = the producer's event \
         record and record; consumer = from reading the line to the synchronised view."
            .into(),
        "Not included: allocating and filling the buffer (a sub-allocation and a kernel, \
         finished before the clock), the consumer's check of 8 words, the release. Columns: \
         per-buffer p50 = the fresh section's row of the same mechanism and size (a new export \
         every sample); PyTorch p50 = its fresh hand-off of the same size in this run."
            .into(),
        format!(
            "Targets: p50 <= {:.3} ms at every size from 2 MiB to 1 GiB, and PyTorch's fresh \
             hand-off p50 / ours >= {:.0}x.",
            crate::report::targets::ARENA_P50_MS,
            crate::report::targets::ARENA_TORCH_SPEEDUP
        ),
    ]
}
