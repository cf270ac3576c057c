//! KV-cache blocks handed off as engines that split prefill and decode do:
//! a producer writes blocks into its arena and hands each to one consumer,
//! whose check reads it. Three ways, each with a consumer of its own:
//! pushed to a consumer asleep in `next_pushed_set` (after 0.1 ms idle, as
//! the wake-up floor's reader), pushed to one that spins, and pulled (the
//! consumer told the name attaches it, as the arena section does).

use std::time::Duration;

use cuda_ipc::arena::SetMember;
use cuda_ipc::exchange::Publisher;
use cuda_ipc::{Dtype, Error, Mechanism};
use serde_json::json;

use crate::Reps;
use crate::plan::PUSH_SIZES;
use crate::proto::{REQUEST_TIMEOUT, failure, get_u64, mono_ns};
use crate::report::targets::{PULL_ASLEEP, PUSH_ASLEEP, PUSH_SPINNING};
use crate::report::{Row, Section, SectionId, human};
use crate::stats::ns_to_ms;

use super::arena::{arena_publisher, filled_buffer, reserve};
use super::{Consumer, Ctx, UNPUBLISH_TIMEOUT, pattern, tag};

/// The stream the blocks are pushed to.
const STREAM: &str = "kv";
/// How long a sleeping consumer has been idle when its block comes.
const IDLE: Duration = Duration::from_micros(100);
/// How long a spinning consumer polls before it sleeps.
const SPIN: Duration = Duration::from_millis(20);

/// One row: blocks of `size` handed to consumer `c` as `series` says.
fn push_row(
    publisher: &Publisher,
    c: &mut Consumer,
    m: Mechanism,
    series: &str,
    size: u64,
    reps: Reps,
) -> Row {
    let row = Row::new(series, "ms").size(size);
    let worker = match c.get() {
        Ok(w) => w,
        Err(e) => return row.failed(e.to_string()),
    };
    let pushed = series != PULL_ASLEEP;
    let (mut total, mut producer, mut consumer) = (Vec::new(), Vec::new(), Vec::new());
    let seed = tag(m, size) ^ 0x9B5C;
    let measured = (|| -> Result<(), Error> {
        reserve(publisher, m, size)?;
        for i in 0..reps.total() {
            let pat = pattern(seed, i);
            let buffer = filled_buffer(publisher, size, pat)?;
            let name = format!("kv/{size}/{i}");
            let shape = [size / 4];
            let member = [SetMember::new("block", Dtype::U32, &shape, &buffer)];
            let (t0, t_pub, answer) = if pushed {
                worker.send(&json!({ "op": "push_take", "base": pat.base, "step": pat.step }))?;
                let waiting = worker.recv(REQUEST_TIMEOUT)?;
                if waiting.get("waiting").is_none() {
                    return Err(failure(format!("sample {i}"), format!("{waiting}")));
                }
                if series == PUSH_ASLEEP {
                    std::thread::sleep(IDLE);
                }
                let t0 = mono_ns();
                publisher.publish_set(&name, &member)?;
                publisher.push_set(&name, STREAM)?;
                let t_pub = mono_ns();
                (t0, t_pub, worker.recv(REQUEST_TIMEOUT))
            } else {
                let t0 = mono_ns();
                publisher.publish_set(&name, &member)?;
                let t_pub = mono_ns();
                let request =
                    json!({ "op": "set_attach", "name": name, "base": pat.base, "step": pat.step });
                let answer = worker
                    .send(&request)
                    .and_then(|()| worker.recv(REQUEST_TIMEOUT));
                (t0, t_pub, answer)
            };
            let unpublished = publisher.unpublish_set(&name, Some(UNPUBLISH_TIMEOUT));
            drop(buffer);
            let answer = answer.map_err(|e| failure(format!("sample {i}"), e))?;
            unpublished.map_err(|e| failure(format!("sample {i}: unpublishing"), e))?;
            if i < reps.warmup {
                continue;
            }
            let t_done = get_u64(&answer, "t_done")?;
            total.push(ns_to_ms(t0, t_done));
            producer.push(ns_to_ms(t0, t_pub));
            consumer.push(ns_to_ms(t_pub, t_done));
        }
        Ok(())
    })();
    let row = row
        .samples(reps.warmup, total)
        .part("publish and push", &producer)
        .part("to the consumer's done", &consumer);
    match measured {
        Ok(()) => row,
        Err(e) => row.failed(e.to_string()),
    }
}

/// The push section (see the module docs) on the device's primary
/// mechanism.
pub fn push(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Push);
    let modes = [PUSH_ASLEEP, PUSH_SPINNING, PULL_ASLEEP];
    let unmeasured = |s: &mut Section, why: &str, skip: bool| {
        for series in modes {
            for size in PUSH_SIZES {
                let row = Row::new(series, "ms").size(size);
                s.rows.push(if skip {
                    row.skip(why.to_string())
                } else {
                    row.failed(why.to_string())
                });
                ctx.progress.done();
            }
        }
    };
    let Some(m) = ctx.primary() else {
        unmeasured(&mut s, "no mechanism of those asked for works here", true);
        return s;
    };
    let publisher = match arena_publisher(ctx, m, "push").and_then(|p| {
        p.publish_stream(STREAM)?;
        Ok(p)
    }) {
        Ok(p) => p,
        Err(e) => {
            unmeasured(&mut s, &e.to_string(), false);
            return s;
        }
    };
    for series in modes {
        let mut c = Consumer::of(ctx, &format!("the {series} consumer"), publisher.path());
        let spin_us = if series == PUSH_SPINNING {
            SPIN.as_micros()
        } else {
            0
        };
        let ready = c.get().and_then(|w| {
            w.send(&json!({ "op": "respin", "spin_us": spin_us as u64 }))?;
            w.recv(REQUEST_TIMEOUT)?;
            if series != PULL_ASLEEP {
                w.send(&json!({ "op": "push_subscribe", "stream": STREAM }))?;
                w.recv(REQUEST_TIMEOUT)?;
            }
            Ok(())
        });
        for size in PUSH_SIZES {
            ctx.progress
                .step(&format!("KV blocks, {series}, {}", human(size)));
            s.rows.push(match &ready {
                Ok(()) => push_row(&publisher, &mut c, m, series, size, ctx.plan.reps(size)),
                Err(e) => Row::new(series, "ms").size(size).failed(e.to_string()),
            });
            ctx.progress.done();
        }
        drop(c);
    }
    drop(publisher);
    s.notes = notes(m);
    s
}

fn notes(m: Mechanism) -> Vec<String> {
    vec![
        format!(
            "One way, on {m} arena chunks mapped once by each consumer: the producer's clock just \
             before Publisher::publish_set of a new block (Publisher::alloc, filled and finished \
             before the clock) to the consumer's after its attach returned and its stream \
             synchronised. Pushed: Publisher::push_set right after, the consumer waiting in \
             Subscriber::next_pushed_set (asleep: it polls for 0 us and has been idle 0.1 ms, \
             as the wake-up floor's reader; spinning: it polls for 20 ms). Pulled: the consumer \
             is told the name through the bench's pipe and attaches it (Subscriber::attach_set), \
             which the total includes."
        ),
        "Columns: wake-up floor = the driver floor section's notice to a reader asleep after \
         0.1 ms idle, this run; ours/floor = p50 over it; PyTorch fresh p50 = the PyTorch \
         anchor's fresh hand-off of a block of the same size (a new tensor put on a \
         torch.multiprocessing queue, its consumer's read synchronised; '-' when the torch \
         section did not run), PyTorch/ours = it over our p50. Not included: allocating and \
         filling the block, the consumer's check of its first and last words, the release, \
         Publisher::unpublish_set."
            .into(),
        format!(
            "Targets: pushed to a sleeping consumer p50 <= {:.3} ms and <= {:.0}x the wake-up \
             floor, to a spinning one <= {:.3} ms, at every size.",
            crate::report::targets::PUSH_ASLEEP_P50_MS,
            crate::report::targets::PUSH_WAKE_RATIO,
            crate::report::targets::PUSH_SPINNING_P50_MS
        ),
    ]
}
