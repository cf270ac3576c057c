//! Weight sets: a model's weights (many fp32 tensors, sizes drawn by
//! [`crate::weights`]) handed off in one call, against PyTorch's list of
//! tensors on a queue and its flattened bucket, and the in-place update of
//! a set already attached; the same from Python, and a fresh Python
//! process's first attach of a model against safetensors' load of it
//! ([`crate::first_attach`]).

use cuda_ipc::arena::{DeviceArenaBuffer, SetMember};
use cuda_ipc::exchange::Publisher;
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{DeviceMemory, Dtype, Error, Mechanism};
use serde_json::json;

use crate::proto::{REQUEST_TIMEOUT, Worker, failure, get_u64, mono_ns};
use crate::report::{Row, Section, SectionId, human};
use crate::stats::ns_to_ms;
use crate::torch;
use crate::worker::{entry_pattern, pad_launches, padded};
use crate::{Plan, Reps};

use super::arena::arena_publisher;
use super::phase_parts::PhaseParts;
use super::{Consumer, Ctx, UNPUBLISH_TIMEOUT, pattern};

/// A weight set in a publisher's arena: one buffer per tensor, and their
/// names and shapes.
struct WeightSet {
    buffers: Vec<DeviceArenaBuffer>,
    names: Vec<String>,
    shapes: Vec<[u64; 1]>,
}

impl WeightSet {
    /// The set of `count` tensors totalling `total` bytes in `publisher`'s
    /// arena, every chunk made and exported before the clock.
    fn new(publisher: &Publisher, count: u64, total: u64) -> Result<WeightSet, Error> {
        let sizes = crate::weights::sizes(count, total)
            .map_err(|e| failure("drawing the weight set", e))?;
        publisher.arena()?.reserve(total)?;
        let buffers = sizes
            .iter()
            .map(|s| publisher.alloc(*s))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| failure(format!("allocating the {count} tensors in the arena"), e))?;
        Ok(WeightSet {
            buffers,
            names: (0..count).map(|j| format!("w{j:05}")).collect(),
            shapes: sizes.iter().map(|s| [s / 4]).collect(),
        })
    }

    /// Every tensor filled with its pattern of `p`, finished; with
    /// [`pad_launches`] above the set's size, the first tensor is filled
    /// again until that many fills were launched.
    fn fill(&self, p: Pattern) -> Result<(), Error> {
        for j in padded(self.buffers.len()) {
            kernels::fill_u32(&self.buffers[j], entry_pattern(p, j), Speed::Full)?;
        }
        self.buffers[0].synchronize()
    }

    fn members(&self) -> Vec<SetMember<'_>> {
        self.buffers
            .iter()
            .zip(&self.names)
            .zip(&self.shapes)
            .map(|((buffer, name), shape)| SetMember::new(name, Dtype::F32, shape, buffer))
            .collect()
    }
}

/// Device memory in use now (all processes), bytes.
fn used(ctx: &Ctx<'_>) -> Result<u64, Error> {
    let (free, total) = ctx.device.memory_info()?;
    Ok(total - free)
}

/// The set hand-off row and the update row of a set of `count` tensors
/// totalling `total` bytes in an arena of `m` chunks.
fn set_rows(ctx: &Ctx<'_>, m: Mechanism, (count, total): (u64, u64), reps: Reps) -> (Row, Row) {
    let row = |v: &str| Row::new("ours", "ms").variant(v).count(count).size(total);
    let made = arena_publisher(ctx, m, "sets")
        .and_then(|p| WeightSet::new(&p, count, total).map(|s| (p, s)));
    let (publisher, set) = match made {
        Ok(x) => x,
        Err(e) => {
            return (
                row("set").failed(e.to_string()),
                row("update").failed(e.to_string()),
            );
        }
    };
    let mut c = Consumer::of(ctx, "the weight sets' consumer", publisher.path());
    let rows = match c.get() {
        Ok(w) => (
            handoff_row(ctx, &publisher, w, &set, row("set"), reps, count),
            update_row(&publisher, w, &set, row("update"), reps, count),
        ),
        Err(e) => (
            row("set").failed(e.to_string()),
            row("update").failed(e.to_string()),
        ),
    };
    // The consumer exits (and unmaps) before the chunks are freed.
    drop(c);
    drop(set);
    drop(publisher);
    rows
}

/// Samples of the whole set's hand-off: refilled (not timed), then timed
/// from `Publisher::publish_set` to the consumer holding every buffer
/// synchronised (`Subscriber::attach_set`).
fn handoff_row(
    ctx: &Ctx<'_>,
    publisher: &Publisher,
    w: &mut Worker,
    set: &WeightSet,
    row: Row,
    reps: Reps,
    count: u64,
) -> Row {
    let (mut samples, mut publish, mut consumer, mut teardown) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut phases = PhaseParts::default();
    let mut extra = 0u64;
    let seed = 0x5E7 ^ (count << 20);
    let members = set.members();
    let measured = (|| -> Result<(), Error> {
        for i in 0..reps.total() {
            let p = pattern(seed, i);
            set.fill(p)?;
            let name = format!("weights/{count}/{i}");
            let request =
                json!({ "op": "set_attach", "name": name, "base": p.base, "step": p.step });
            let before = used(ctx)?;
            let t0 = mono_ns();
            publisher.publish_set(&name, &members)?;
            let t_pub = mono_ns();
            let answer = w.send(&request).and_then(|()| w.recv(REQUEST_TIMEOUT));
            // Read once the consumer has answered, outside its clock.
            let publish_phases = cuda_ipc::phases::last("core.publish_set");
            let after = used(ctx)?;
            let t = std::time::Instant::now();
            let unpublished = publisher.unpublish_set(&name, Some(UNPUBLISH_TIMEOUT));
            let teardown_ms = t.elapsed().as_secs_f64() * 1e3;
            let a = answer.map_err(|e| failure(format!("sample {i}"), e))?;
            unpublished.map_err(|e| failure(format!("sample {i}: unpublishing"), e))?;
            if a["entries"].as_u64() != Some(count) {
                return Err(failure(
                    format!("sample {i}"),
                    format!("the consumer saw {a}"),
                ));
            }
            if i < reps.warmup {
                continue;
            }
            // The first samples map the chunks; kept samples allocate nothing.
            extra = extra.max(after.saturating_sub(before));
            let (t_recv, t_done) = (get_u64(&a, "t_recv")?, get_u64(&a, "t_done")?);
            samples.push(ns_to_ms(t0, t_done));
            publish.push(ns_to_ms(t0, t_pub));
            consumer.push(ns_to_ms(t_recv, t_done));
            teardown.push(teardown_ms);
            phases.add("publish", &publish_phases);
            phases.add_json("attach_set", &a["phases"]);
        }
        Ok(())
    })();
    let row = phases
        .into_row(row)
        .samples(reps.warmup, samples)
        .part("publish", &publish)
        .part("consumer", &consumer)
        .part("teardown", &teardown)
        .extra_device_bytes(extra);
    match measured {
        Ok(()) => row,
        Err(e) => row.failed(e.to_string()),
    }
}

/// Samples of the update of a set the consumer holds: refilled (not
/// timed), the consumer waiting; then timed from `Publisher::update_set`
/// (one event for the set, one notice) to the consumer's
/// `Subscriber::wait_set_update` returning and its stream synchronised.
fn update_row(
    publisher: &Publisher,
    w: &mut Worker,
    set: &WeightSet,
    row: Row,
    reps: Reps,
    count: u64,
) -> Row {
    let (mut samples, mut update) = (Vec::new(), Vec::new());
    let mut phases = PhaseParts::default();
    let seed = 0x0DA7E ^ (count << 20);
    let name = format!("weights/{count}/held");
    let members = set.members();
    let measured = (|| -> Result<(), Error> {
        let p0 = pattern(seed, 0);
        set.fill(p0)?;
        publisher.publish_set(&name, &members)?;
        w.request(
            &json!({ "op": "set_hold", "name": name, "base": p0.base, "step": p0.step }),
            REQUEST_TIMEOUT,
        )?;
        for i in 1..=reps.total() {
            let p = pattern(seed, i);
            set.fill(p)?;
            w.request(
                &json!({ "op": "set_await", "name": name, "base": p.base, "step": p.step }),
                REQUEST_TIMEOUT,
            )?;
            let t0 = mono_ns();
            publisher.update_set(&name)?;
            let t_upd = mono_ns();
            let updated = cuda_ipc::phases::last("core.update_set");
            let a = w
                .recv(REQUEST_TIMEOUT)
                .map_err(|e| failure(format!("update {i}"), e))?;
            if i > reps.warmup {
                samples.push(ns_to_ms(t0, get_u64(&a, "t_done")?));
                update.push(ns_to_ms(t0, t_upd));
                phases.add("update", &updated);
            }
        }
        w.request(&json!({ "op": "set_drop", "name": name }), REQUEST_TIMEOUT)?;
        Ok(())
    })();
    let unpublished = publisher.unpublish_set(&name, Some(UNPUBLISH_TIMEOUT));
    let row = phases
        .into_row(row)
        .samples(reps.warmup, samples)
        .part("update", &update);
    match (measured, unpublished) {
        (Err(e), _) => row.failed(e.to_string()),
        (Ok(()), Err(e)) => row.failed(format!("unpublishing: {e}")),
        (Ok(()), Ok(())) => row,
    }
}

/// Adds the error of a script (`what`), if any, to the section's.
fn add_error(s: &mut Section, what: &str, error: Option<String>) {
    if let Some(e) = error {
        let e = format!("{what}: {e}");
        s.error = Some(match s.error.take() {
            Some(prev) => format!("{prev}; {e}"),
            None => e,
        });
    }
}

/// The sets section: ours and its update per set, then PyTorch's list and
/// bucket per set (one run of the script).
pub fn sets(ctx: &Ctx<'_>) -> Section {
    let mut s = Section::new(SectionId::Sets);
    let reps = ctx.plan.set_reps;
    let primary = ctx.primary();
    for &(count, total) in &ctx.plan.sets {
        ctx.progress
            .step(&format!("weight set, {count} tensors / {}", human(total)));
        let (set, update) = if let Some(m) = primary {
            set_rows(ctx, m, (count, total), reps)
        } else {
            let why = "none of the mechanisms asked for is supported here";
            let row = |v: &str| {
                Row::new("ours", "ms")
                    .variant(v)
                    .count(count)
                    .size(total)
                    .skip(why)
            };
            (row("set"), row("update"))
        };
        s.rows.push(set);
        ctx.progress.done();
        s.rows.push(update);
        ctx.progress.done();
    }
    ctx.progress
        .step("PyTorch weight sets (bench/torch_share.py --sets)");
    let (rows, torch_notes, error) = torch::set_rows(ctx.plan);
    s.rows.extend(rows);
    s.error = error.map(|e| format!("PyTorch's weight sets: {e}"));
    ctx.progress.done();
    ctx.progress
        .step("ours from Python (bench/cuda_ipc_share.py --plan --sets)");
    let (rows, py_notes, py_error) = torch::python_rows(ctx.plan);
    s.rows.extend(rows);
    add_error(&mut s, "ours from Python", py_error);
    ctx.progress.done();
    ctx.progress
        .step("first attach in a new process (bench/first_attach.py)");
    let (rows, first_notes, first_error) = crate::first_attach::rows(ctx.plan);
    s.rows.extend(rows);
    add_error(&mut s, "first attach", first_error);
    ctx.progress.done();
    s.notes = notes(ctx.plan);
    if pad_launches() > 0 {
        s.notes.push(format!(
            "CUDA_IPC_BENCH_PAD={}: every Rust set's fill and check worked on at least that many \
             buffers (a diagnostic; the Python rows are not padded)",
            pad_launches()
        ));
    }
    if let Some(m) = primary {
        s.notes.insert(
            0,
            format!("ours: a publisher whose arena has {m} chunks (Sharing::arena)."),
        );
    }
    s.notes.extend(torch_notes);
    s.notes.extend(py_notes);
    s.notes.extend(first_notes);
    s
}

/// What the section's figures include.
pub(crate) fn notes(plan: &Plan) -> Vec<String> {
    use crate::report::targets as t;
    let mut notes = vec![
        "A weight set: N fp32 tensors totalling the size shown, their sizes drawn from a fixed \
         seed (splitmix64, the rule in weights.rs and bench/torch_share.py; the same list for \
         every contender). The tensors live across samples, as a trainer's parameters do; \
         each sample refills every one with its own value before the clock (not timed), and \
         the consumer checks the first and last value of every tensor after it (not timed)."
            .into(),
        "ours set: the clock from just before Publisher::publish_set (the buffers in the \
         publisher's arena, whose chunks were made and exported before the first sample) to \
         the consumer's after Subscriber::attach_set returned and its stream synchronised \
         (one attach of the whole set; each chunk mapped once, on the warm-up samples, and \
         kept in the consumer's cache; the same layout every sample, so the publisher reuses \
         the layout it described, Publisher::set_layouts, and the consumer the entry table it \
         kept, Subscriber::entry_tables, from Rust and Python). extra = device memory in use \
         (cuMemGetInfo, all processes) after the hand-off minus before it. ours update: the consumer holds the \
         set and waits; the clock from just before Publisher::update_set (one event for the \
         set, one notice) to Subscriber::wait_set_update returning and the stream synchronised. \
         The line under an update row (from Rust and from Python) is the producer's call alone, \
         whose cost should not grow with the number of tensors."
            .into(),
        "ours from Python (bench/cuda_ipc_share.py, the installed cuda_ipc wheel, two Python \
         processes): set = the clock from just before Publisher.publish_state_dict of the \
         weight set, whose tensors were made once in the publisher's arena \
         (cuda_ipc.torch.shareable, so nothing is copied), to the consumer's after \
         Subscriber.attach_state_dict returned its dict of torch tensors (the event waited \
         for); update = the consumer holds that state dict and waits in \
         StateDict.wait_update, the clock from just before Publisher.update_state_dict to \
         wait_update returning (its event waited for); fresh = a new arena buffer published \
         as a set of one (publish_set), to the consumer's after attach_set and as_torch \
         returned."
            .into(),
        "first attach (bench/first_attach.py): a Qwen2-shaped bfloat16 model of 4.37 GB (291 \
         keys, 290 tensors: the embedding and the output projection tied), made in one chunk \
         of a running publisher's arena (cuda_ipc.torch.shareable with reserve = \
         reserve_bytes of the model's shapes) and published once; per sample a new Python \
         process imports cuda_ipc and torch and starts CUDA (not timed), then the clock runs \
         from just before cuda_ipc.Subscriber() to attach_state_dict returning (keys, shapes, ties and the sum of every tensor \
         checked after, not timed). safetensors load_file: the same tensors written once to a \
         file and read once (page cache), then load_file(path, device=\"cuda:N\") and \
         torch.cuda.synchronize() in the same processes; it/ours is its p50 over the first \
         attach's. The model is the same in a --quick run."
            .into(),
        "PyTorch list: the clock from just before torch.multiprocessing's Queue.put of the list \
         of tensors to the consumer's after Queue.get returned and its stream synchronised. \
         PyTorch bucket: the clock from just before torch.cat packs the tensors into one (the \
         \"flattened bucket\"), then that one tensor on the queue; the consumer splits it back \
         into views (torch.split) and synchronises. extra = device memory the producer needed \
         beyond the tensors (the bucket's copy; torch.cuda.max_memory_allocated)."
            .into(),
        format!(
            "Targets: {} tensors <= {:.1} ms, PyTorch list / ours >= {:.0}x, PyTorch bucket / \
             ours >= {:.0}x, with no extra device memory; {} tensors <= {:.1} ms; the update \
             <= {:.3} ms.",
            t::SET_LARGE,
            t::SET_LARGE_P50_MS,
            t::SET_LIST_SPEEDUP,
            t::SET_BUCKET_SPEEDUP,
            t::SET_SMALL,
            t::SET_SMALL_P50_MS,
            t::SET_UPDATE_P50_MS,
        ),
        format!(
            "Targets from Python: {} tensors p50 <= {:.1} ms, p99 <= {:.1} ms, <= {:.2}x ours \
             from Rust, PyTorch list / ours >= {:.0}x, PyTorch bucket / ours >= {:.0}x, the \
             update <= {:.3} ms; {} tensors <= {:.0} ms; the first attach <= {:.1} ms and \
             safetensors / ours >= {:.0}x.",
            t::SET_LARGE,
            t::PY_SET_LARGE_P50_MS,
            t::PY_SET_LARGE_P99_MS,
            t::PY_RUST_RATIO,
            t::PY_LIST_SPEEDUP,
            t::PY_BUCKET_SPEEDUP,
            t::PY_UPDATE_P50_MS,
            t::SET_HUGE,
            t::PY_SET_HUGE_P50_MS,
            t::FIRST_ATTACH_P50_MS,
            t::SAFETENSORS_SPEEDUP,
        ),
    ];
    for &(count, total) in &plan.sets {
        match crate::weights::sizes(count, total) {
            Ok(sizes) => notes.push(format!(
                "The {count}-tensor set: {} in tensors of {} to {}.",
                human(total),
                human(sizes.iter().copied().min().unwrap_or(0)),
                human(sizes.iter().copied().max().unwrap_or(0)),
            )),
            Err(e) => notes.push(format!("The {count}-tensor set: {e}")),
        }
    }
    if plan.quick {
        notes.push(format!(
            "--quick: the sets total {} instead of {} (the targets are set for {}).",
            human(crate::plan::SET_TOTAL_QUICK),
            human(crate::plan::SET_TOTAL),
            human(crate::plan::SET_TOTAL)
        ));
    }
    notes
}
