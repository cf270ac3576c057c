//! The machine's wake-up floor, in the driver floor's section: how long a
//! notice through shared memory takes to reach a process that waits for it,
//! with no GPU work at all. The notice is what the library's own notices
//! use ([`cuda_ipc_shm`]: a record in a ring both processes map, and the
//! reader's wake-up socket written only when it sleeps). Before each
//! sample both processes are idle for a while (the producer sleeps, the
//! reader waits), as between the hand-offs of the other sections, so each
//! row says what a notice to a waiting consumer costs here at the least:
//! asleep after 0.1, 1 and 10 ms, and spinning (no system call).

use std::os::fd::OwnedFd;
use std::time::Duration;

use cuda_ipc::{Error, channel};
use cuda_ipc_shm::{Area, MIN_CAPACITY, Sender, Side, wake_pair};
use serde_json::json;

use crate::proto::{REQUEST_TIMEOUT, Worker, get_u64, mono_ns};
use crate::report::{Row, SPIN_IDLE_US, WAKE_IDLE_US, WAKE_SERIES};
use crate::stats::ns_to_ms;
use crate::worker::wake::shm_failure;

use super::Ctx;

/// How long past the idle time the spinning reader spins before it would
/// sleep: long enough that every notice finds it spinning.
const SPIN_SLACK_US: u64 = 20_000;

/// The producer's end: the ring it writes notices into.
pub(super) struct WakeRig {
    sender: Sender,
    /// The consumer's replies would come here; only kept open, so that the
    /// consumer's end of the area stays whole.
    _receiver: cuda_ipc_shm::Receiver,
}

impl WakeRig {
    /// Makes the area and its wake-up pair, hands the reader's end and the
    /// area to `worker` through
    /// the floor's channel (as the library's server hands its notices' area
    /// to a client) and waits until it opened them.
    pub(super) fn new(server: &channel::Server, worker: &mut Worker) -> Result<WakeRig, Error> {
        let (wake, fds) = WakeRig::make()?;
        let name = format!("floor/wake/{}", std::process::id());
        server.publish(&name, json!({}), fds.into())?;
        let opened = worker.request(
            &json!({ "op": "wake_setup", "name": name, "capacity": MIN_CAPACITY }),
            REQUEST_TIMEOUT,
        );
        let gone = server
            .unpublish(&name)
            .and_then(|()| server.wait_released(&name, Some(REQUEST_TIMEOUT)));
        opened?;
        gone?;
        Ok(wake)
    }

    /// The producer's end, and what the reader opens its end from: the
    /// area's memfd and the reader's end of the wake-up pair.
    pub(crate) fn make() -> Result<(WakeRig, [OwnedFd; 2]), Error> {
        let (area, memfd) =
            Area::create(MIN_CAPACITY).map_err(|e| shm_failure("making the area", e))?;
        let (ours, theirs) = wake_pair().map_err(|e| shm_failure("a wake-up pair", e))?;
        let fds = [memfd, theirs];
        let (sender, receiver) = area
            .split(Side::Creator, ours)
            .map_err(|e| shm_failure("the area", e))?;
        Ok((
            WakeRig {
                sender,
                _receiver: receiver,
            },
            fds,
        ))
    }

    /// One notice: the consumer told to wait (spinning up to `spin_us`
    /// first, then asleep), both
    /// idle for `idle`, then the clock from just before the record's write
    /// to the consumer's return from its wait. Returns that, the write
    /// alone (ms), and whether the write found it asleep.
    fn sample(
        &mut self,
        w: &mut Worker,
        idle: Duration,
        spin_us: u64,
    ) -> Result<(f64, f64, bool), Error> {
        w.send(&json!({ "op": "wake_wait", "spin_us": spin_us }))?;
        std::thread::sleep(idle);
        let (t0, t_sent, woke) = self.notify()?;
        let a = w.recv(REQUEST_TIMEOUT)?;
        let t_wake = get_u64(&a, "t_wake")?;
        if t_wake < t0 {
            return Err(shm_failure(
                "the consumer's clock",
                format!("it woke at {t_wake} ns, before the notice was written at {t0} ns"),
            ));
        }
        Ok((ns_to_ms(t0, t_wake), ns_to_ms(t0, t_sent), woke))
    }

    /// Writes one notice (its own clock, 8 bytes): the time just before
    /// the write and just after (CLOCK_MONOTONIC, ns), and whether the
    /// write found the reader asleep (and sent it a wake-up).
    pub(crate) fn notify(&mut self) -> Result<(u64, u64, bool), Error> {
        let wakes = self.sender.wakes();
        let t0 = mono_ns();
        let sent = self
            .sender
            .send(&t0.to_le_bytes())
            .map_err(|e| shm_failure("writing the notice", e))?;
        let t_sent = mono_ns();
        if !sent {
            return Err(shm_failure(
                "writing the notice",
                "the ring is full: the consumer did not read the last notices",
            ));
        }
        Ok((t0, t_sent, self.sender.wakes() > wakes))
    }
}

/// How the reader of a wake-up row waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// It sleeps in `poll(2)` at once.
    Asleep,
    /// It polls the ring, no system call.
    Spinning,
}

/// The rows: how the reader waits, and the idle time before each notice, µs.
fn cases() -> impl Iterator<Item = (How, u64)> {
    WAKE_IDLE_US
        .iter()
        .map(|us| (How::Asleep, *us))
        .chain([(How::Spinning, SPIN_IDLE_US)])
}

/// The variant of the row whose reader waits `how` after `idle_us` of
/// idleness.
pub fn wake_variant(how: How, idle_us: u64) -> String {
    let ms = |us: u64| us as f64 / 1000.0;
    let how = match how {
        How::Asleep => "asleep".to_string(),
        How::Spinning => "spinning".to_string(),
    };
    format!("{how}, {} ms idle", ms(idle_us))
}

/// One row: `reps` notices after `idle_us` each, the reader waiting `how`.
fn wake_row(
    ctx: &Ctx<'_>,
    rig: &mut WakeRig,
    w: &mut Worker,
    how: How,
    idle_us: u64,
) -> (Row, Option<String>) {
    let reps = ctx.plan.reps_small;
    let variant = wake_variant(how, idle_us);
    let mut row = Row::new(WAKE_SERIES, "ms").variant(&variant);
    let spin_us = match how {
        How::Asleep => 0,
        How::Spinning => idle_us + SPIN_SLACK_US,
    };
    let (mut one_way, mut write) = (Vec::new(), Vec::new());
    let mut slept = 0usize;
    for i in 0..reps.total() {
        match rig.sample(w, Duration::from_micros(idle_us), spin_us) {
            Ok((t, s, woke)) if i >= reps.warmup => {
                one_way.push(t);
                write.push(s);
                slept += usize::from(woke);
            }
            Ok(_) => {}
            Err(e) => {
                row = row.failed(format!("sample {i}: {e}"));
                break;
            }
        }
    }
    let n = one_way.len();
    // A sleeping reader must have slept every time, a spinning one never.
    let odd = match how {
        How::Asleep => n - slept,
        How::Spinning => slept,
    };
    let note = (odd > 0 && row.error.is_none()).then(|| {
        format!(
            "wake {variant}: the reader was {} in {odd} of {n} samples",
            if how == How::Asleep {
                "awake"
            } else {
                "asleep"
            }
        )
    });
    (
        row.samples(reps.warmup, one_way).part("write", &write),
        note,
    )
}

/// The wake-up rows, one progress step each, and any note on them.
/// The reader is `w`, connected to `server` (the driver floor's channel),
/// through which it gets the area.
pub(super) fn wake_rows(
    ctx: &Ctx<'_>,
    server: &channel::Server,
    w: &mut Worker,
) -> (Vec<Row>, Vec<String>) {
    let mut wake = match WakeRig::new(server, w) {
        Ok(x) => x,
        Err(e) => {
            let rows = cases()
                .map(|(how, us)| {
                    ctx.progress.done();
                    Row::new(WAKE_SERIES, "ms")
                        .variant(wake_variant(how, us))
                        .failed(format!("setting up: {e}"))
                })
                .collect();
            return (rows, Vec::new());
        }
    };
    let (mut rows, mut notes) = (Vec::new(), Vec::new());
    for (how, us) in cases() {
        ctx.progress
            .step(&format!("driver floor: {}", wake_variant(how, us)));
        let (row, note) = wake_row(ctx, &mut wake, w, how, us);
        rows.push(row);
        notes.extend(note);
        ctx.progress.done();
    }
    (rows, notes)
}

/// One notice of [`rounds`]: the write's clock and the reader's
/// (CLOCK_MONOTONIC, ns), whether the write woke the reader through its
/// wake-up socket, and how many times the reader slept for it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Round {
    pub(crate) t0: u64,
    pub(crate) t_wake: u64,
    pub(crate) woke: bool,
    pub(crate) slept: u64,
}

/// The same notices between two threads of this process: a reader opened
/// from the descriptors [`WakeRig::make`] hands out waits (spinning up to
/// `spin` first), and `n` notices are written, each after `idle`.
pub(crate) fn rounds(spin: Duration, idle: Duration, n: usize) -> Result<Vec<Round>, Error> {
    let (mut rig, [memfd, reader_end]) = WakeRig::make()?;
    let mut reader = crate::worker::wake::Wake::open(&memfd, reader_end, MIN_CAPACITY)?;
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("cuda-ipc-wake-probe".into())
        .spawn(move || {
            for _ in 0..n {
                let got = reader.wait(spin);
                let failed = got.is_err();
                if tx.send(got).is_err() || failed {
                    return;
                }
            }
        })
        .map_err(|e| shm_failure("starting the reader thread", e))?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        std::thread::sleep(idle);
        let (t0, _, woke) = rig.notify()?;
        let (t_wake, slept) = rx
            .recv()
            .map_err(|_| shm_failure("the reader thread", "it ended early"))??;
        out.push(Round {
            t0,
            t_wake,
            woke,
            slept,
        });
    }
    let _ = thread.join();
    Ok(out)
}

/// What [`probe`] found: a notice through shared memory between two
/// threads of this process, p50 ms, to a reader asleep after `idle_ms` and
/// to one spinning.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct WakeProbe {
    /// The idle time before each notice, ms.
    pub idle_ms: f64,
    /// Notices per reader.
    pub samples: usize,
    /// Write to return of a reader that slept in `poll(2)`, p50 ms.
    pub asleep_p50_ms: f64,
    /// Of those notices, how many found the reader asleep (the others
    /// came before it slept: a late thread).
    pub asleep: usize,
    /// Write to return of a reader that spun on the ring, p50 ms.
    pub spinning_p50_ms: f64,
}

/// Notices per reader of a [`probe`] that `cuda-ipc info` and `demo
/// --stream` print: enough for a median, a few tens of milliseconds.
pub const PROBE_SAMPLES: usize = 21;

/// The machine's wake-up floor measured in this process (no GPU, about
/// `n * 2 * idle`): `n` notices to a reader that sleeps at once and `n` to
/// one that spins, each after `idle`.
pub fn probe(idle: Duration, n: usize) -> Result<WakeProbe, Error> {
    // The median of the rounds, and how many found the reader asleep.
    let measure = |spin: Duration| -> Result<(f64, usize), Error> {
        let rounds = rounds(spin, idle, n)?;
        let mut ms: Vec<f64> = rounds.iter().map(|r| ns_to_ms(r.t0, r.t_wake)).collect();
        ms.sort_by(f64::total_cmp);
        let asleep = rounds.iter().filter(|r| r.woke && r.slept == 1).count();
        Ok((crate::stats::percentile(&ms, 0.5), asleep))
    };
    let (asleep_p50_ms, asleep) = measure(Duration::ZERO)?;
    let (spinning_p50_ms, _) = measure(idle + Duration::from_micros(SPIN_SLACK_US))?;
    Ok(WakeProbe {
        idle_ms: idle.as_secs_f64() * 1e3,
        samples: n,
        asleep_p50_ms,
        asleep,
        spinning_p50_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rounds(spin: Duration, idle: Duration, n: usize) -> Vec<(u64, u64, bool, u64)> {
        super::rounds(spin, idle, n)
            .unwrap()
            .into_iter()
            .map(|r| (r.t0, r.t_wake, r.woke, r.slept))
            .collect()
    }

    #[test]
    fn a_sleeping_reader_is_woken_through_its_wake_up_socket_after_the_write() {
        let samples = rounds(Duration::ZERO, Duration::from_millis(20), 5);
        for (t0, t_wake, woke, slept) in &samples {
            assert!(t_wake >= t0, "the reader returned before the write");
            // The write sent a wake-up exactly when the reader slept.
            assert_eq!(*slept, u64::from(*woke), "{samples:?}");
        }
        // A reader that does not spin sleeps after 20 ms of waiting (a
        // loaded test machine may start its thread late now and then).
        let asleep = samples.iter().filter(|s| s.2).count();
        assert!(asleep >= 3, "{samples:?}");
    }

    #[test]
    fn a_spinning_reader_needs_no_wake_up() {
        // Two cores at least: the reader spins while this thread writes.
        if std::thread::available_parallelism().map_or(1, std::num::NonZero::get) < 2 {
            return;
        }
        let samples = rounds(Duration::from_secs(5), Duration::from_millis(2), 5);
        let awake = samples.iter().filter(|s| !s.2 && s.3 == 0).count();
        for (t0, t_wake, _, _) in &samples {
            assert!(t_wake >= t0);
        }
        // A loaded test machine may deschedule the spinning thread now
        // and then; most notices must find it awake.
        assert!(awake >= 3, "{samples:?}");
    }

    #[test]
    fn wake_rows_are_named_by_how_the_reader_waits_and_the_idle_time() {
        assert_eq!(wake_variant(How::Asleep, 100), "asleep, 0.1 ms idle");
        assert_eq!(wake_variant(How::Asleep, 10_000), "asleep, 10 ms idle");
        assert_eq!(
            wake_variant(How::Spinning, SPIN_IDLE_US),
            "spinning, 1 ms idle"
        );
        assert_eq!(cases().count() as u64, crate::report::WAKE_ROWS);
        assert_eq!(crate::report::WAKE_ROWS, 4);
    }

    #[test]
    fn the_probe_gives_both_medians() {
        let p = probe(Duration::from_millis(2), 5).unwrap();
        assert_eq!((p.idle_ms, p.samples), (2.0, 5));
        assert!(p.asleep >= 3, "{p:?}");
        assert!(p.asleep_p50_ms > 0.0 && p.asleep_p50_ms < 1000.0, "{p:?}");
        assert!(
            p.spinning_p50_ms >= 0.0 && p.spinning_p50_ms < 1000.0,
            "{p:?}"
        );
    }
}
