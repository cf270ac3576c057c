//! The producer's side of each GPU section. Every section starts its
//! consumer process(es) once, measures row after row, and records a failed
//! row (with the error, naming what failed) instead of stopping; a consumer
//! that died is started again for the next row.

mod arena;
mod bandwidth;
mod cached;
mod floor;
mod fresh;
mod peer;
mod phase_parts;
mod push;
mod ring;
mod scale;
mod sets;
mod sync;
mod wake;

pub use arena::arena;
pub use bandwidth::bandwidth;
pub use cached::cached;
pub use floor::floor;
pub use fresh::fresh;
pub use peer::peer;
pub use push::push;
pub use ring::ring;
pub use scale::scale;
pub use sets::sets;
pub use sync::sync;
pub use wake::{PROBE_SAMPLES as WAKE_PROBE_SAMPLES, WakeProbe, probe as wake_probe};

use std::time::{Duration, Instant};

use cuda_ipc::device::Capabilities;
use cuda_ipc::exchange::Publisher;
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Device, DeviceMemory, Dtype, Error, Mechanism};
use serde_json::{Value, json};

use crate::namespaces::ConsumerNamespaces;
use crate::proto::{REQUEST_TIMEOUT, Worker, failure, mono_ns};
use crate::report::{PeerInfo, Row, Section, human};
use crate::{Plan, Progress};

/// How long the producer waits for consumers to release a buffer.
const UNPUBLISH_TIMEOUT: Duration = Duration::from_secs(30);

/// What every section needs.
pub struct Ctx<'a> {
    pub device: &'a Device,
    pub caps: &'a Capabilities,
    pub plan: &'a Plan,
    pub publisher: &'a Publisher,
    pub progress: &'a Progress,
    /// The second GPU (`--devices A,B`) and its link to the first.
    pub peer: Option<PeerInfo>,
}

impl Ctx<'_> {
    /// Why the device cannot share with `m`, if it cannot.
    fn unsupported(&self, m: Mechanism) -> Option<String> {
        share::check_mechanism(self.caps, m)
            .err()
            .map(|e| e.to_string())
    }

    /// The mechanism for the ring and scale sections: the best the device
    /// supports among those asked for (vmm, then pool, then legacy).
    fn primary(&self) -> Option<Mechanism> {
        Mechanism::ALL
            .into_iter()
            .find(|m| self.plan.mechanisms.contains(m) && self.unsupported(*m).is_none())
    }

    /// The publisher's socket path, for consumers.
    fn socket(&self) -> String {
        self.publisher.path().display().to_string()
    }
}

/// A consumer process that is started again if it died.
struct Consumer {
    worker: Option<Worker>,
    label: String,
    device: usize,
    socket: String,
    namespaces: ConsumerNamespaces,
}

impl Consumer {
    /// A consumer on the producer's GPU.
    fn new(ctx: &Ctx<'_>, label: &str) -> Consumer {
        Consumer::on(ctx, label, ctx.plan.device)
    }

    /// A consumer on GPU `device`.
    fn on(ctx: &Ctx<'_>, label: &str, device: usize) -> Consumer {
        Consumer {
            worker: None,
            label: label.to_string(),
            device,
            socket: ctx.socket(),
            namespaces: ctx.plan.namespaces.clone(),
        }
    }

    /// A consumer on the producer's GPU, of the publisher at `socket`.
    fn of(ctx: &Ctx<'_>, label: &str, socket: &std::path::Path) -> Consumer {
        Consumer {
            socket: socket.display().to_string(),
            ..Consumer::new(ctx, label)
        }
    }

    /// The running consumer, connected to the publisher.
    fn get(&mut self) -> Result<&mut Worker, Error> {
        let alive = self.worker.as_mut().is_some_and(Worker::alive);
        if !alive {
            self.worker = None;
            let mut w = Worker::start(self.device, &self.namespaces, &self.label)?;
            w.request(
                &json!({ "op": "connect", "socket": self.socket }),
                REQUEST_TIMEOUT,
            )?;
            self.worker = Some(w);
        }
        Ok(self.worker.as_mut().expect("started above"))
    }
}

/// The pattern of sample `i` of a measurement tagged `tag`: distinct per
/// sample, so a consumer that reads a stale buffer is caught.
fn pattern(tag: u64, i: usize) -> Pattern {
    Pattern::ramp(
        (i as u32)
            .wrapping_mul(0x9E37_79B9)
            .wrapping_add(tag as u32),
        1,
    )
}

fn tag(m: Mechanism, size: u64) -> u64 {
    (size >> 12) ^ ((m as u64) << 40)
}

fn allocate(ctx: &Ctx<'_>, m: Mechanism, size: u64) -> Result<SharedBuffer, Error> {
    SharedBuffer::alloc(ctx.device, size as usize, Some(m)).map_err(|e| {
        failure(
            format!("allocating {} with the {m} mechanism", human(size)),
            e,
        )
    })
}

/// Allocates, fills and finishes a buffer (none of it timed).
fn filled(ctx: &Ctx<'_>, m: Mechanism, size: u64, p: Pattern) -> Result<SharedBuffer, Error> {
    let b = allocate(ctx, m, size)?;
    kernels::fill_u32(&b, p, Speed::Full)?;
    b.synchronize()?;
    Ok(b)
}

/// One fresh hand-off to every consumer in `workers`.
struct Handoff {
    t0: u64,
    t_pub: u64,
    answers: Vec<Value>,
    teardown_ms: f64,
}

/// A new buffer of `size`, filled with `p` and finished, then timed:
/// published, each consumer told its name, each attaches and synchronises;
/// then (not timed) they check and release it and the producer unpublishes
/// and frees it.
fn handoff(
    ctx: &Ctx<'_>,
    workers: &mut [&mut Worker],
    m: Mechanism,
    size: u64,
    name: &str,
    p: Pattern,
) -> Result<Handoff, Error> {
    let buffer = filled(ctx, m, size, p)?;
    let request = json!({ "op": "attach", "name": name, "base": p.base, "step": p.step });
    let t0 = mono_ns();
    let published = ctx.publisher.publish(name, buffer, Dtype::U32, None)?;
    let t_pub = mono_ns();
    let mut error = None;
    let mut sent = 0;
    for w in workers.iter_mut() {
        match w.send(&request) {
            Ok(()) => sent += 1,
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    let mut answers = Vec::with_capacity(sent);
    for w in workers.iter_mut().take(sent) {
        match w.recv(REQUEST_TIMEOUT) {
            Ok(v) => answers.push(v),
            Err(e) => {
                error.get_or_insert(e);
            }
        }
    }
    let t = Instant::now();
    let unpublished = ctx.publisher.unpublish(name, Some(UNPUBLISH_TIMEOUT));
    drop(published);
    let unpublished = unpublished.map(drop);
    // The buffer's free, retired by its drop, finished here: the next
    // sample's clock must not run over it (see `settle_retired`).
    crate::proto::settle_retired();
    let teardown_ms = t.elapsed().as_secs_f64() * 1e3;
    if let Some(e) = error {
        return Err(e);
    }
    unpublished?;
    Ok(Handoff {
        t0,
        t_pub,
        answers,
        teardown_ms,
    })
}

fn skipped_rows(s: &mut Section, ctx: &Ctx<'_>, series: &str, why: &str, per: u64) {
    for size in &ctx.plan.sizes {
        s.rows.push(Row::new(series, "ms").size(*size).skip(why));
    }
    for _ in 0..per {
        ctx.progress.done();
    }
}

/// Why `m` cannot share `size` bytes here, if it cannot.
fn too_large(m: Mechanism, size: u64) -> Option<String> {
    (m == Mechanism::Pool && size > cuda_ipc::pool::MAX_SHARED_ALLOCATION).then(|| {
        format!(
            "pool allocations over {} are refused (importing an 8 GiB one crashed the consumer on driver 580)",
            human(cuda_ipc::pool::MAX_SHARED_ALLOCATION)
        )
    })
}

/// One row per mechanism and size, measured by `measure` with consumer
/// `c` (started again if it died), tagged `variant` where given; skipped
/// rows for what the device or the library cannot share.
fn handoff_rows(
    ctx: &Ctx<'_>,
    s: &mut Section,
    c: &mut Consumer,
    variant: Option<&str>,
    what: &str,
    measure: impl Fn(&mut Worker, Mechanism, u64) -> Row,
) {
    let tagged = |row: Row| match variant {
        Some(v) => row.variant(v),
        None => row,
    };
    for &m in &ctx.plan.mechanisms {
        let unsupported = ctx.unsupported(m);
        for &size in &ctx.plan.sizes {
            let row = Row::new(m.name(), "ms").size(size);
            if let Some(why) = unsupported.clone().or_else(|| too_large(m, size)) {
                s.rows.push(tagged(row.skip(why)));
                ctx.progress.done();
                continue;
            }
            ctx.progress.step(&format!("{what}, {m}, {}", human(size)));
            let row = match c.get() {
                Ok(w) => measure(w, m, size),
                Err(e) => row.failed(e.to_string()),
            };
            s.rows.push(tagged(row));
            ctx.progress.done();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_per_sample_and_measurement() {
        let t = tag(Mechanism::Vmm, 2 << 20);
        assert_ne!(pattern(t, 0), pattern(t, 1));
        assert_ne!(
            tag(Mechanism::Vmm, 2 << 20),
            tag(Mechanism::Legacy, 2 << 20)
        );
        assert_ne!(tag(Mechanism::Vmm, 2 << 20), tag(Mechanism::Vmm, 64 << 20));
        assert_eq!(pattern(t, 3).step, 1);
    }
}
