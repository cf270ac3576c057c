//! `cuda-ipc demo --stream`: a producer streams frames to a consumer process
//! through a ring of shared buffers with back-pressure, and both report
//! frames per second and per-frame latency.
//!
//! The producer streams flat out for `--seconds`, then sends
//! [`PACED_FRAMES`] frames [`PACE`] apart. A frame's latency runs from the
//! moment the producer starts writing it (before its fill kernel is queued)
//! to the moment the frame is usable in the consumer (the consumer's stream
//! waited on the frame's event or fence and synchronised), measured with
//! CLOCK_MONOTONIC, which both processes share; the consumer then checks
//! every value of the frame (of every `--check-every`-th frame, and of
//! every paced one). Flat out, a frame also waits behind those
//! queued before it in the ring (up to `--slots` of them): that latency is
//! the queue's. The paced frames find the ring empty: theirs is the
//! hand-off's own, the figure the bench's paced ring rows measure.

use std::ffi::OsStr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use cuda_ipc::exchange::{Endpoint, Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{Device, DeviceMemory, Error, channel::ChannelError};
use serde_json::{Value, json};

use super::demo_args::Args;
use super::{human, mono_ns};
use crate::Outcome;
use crate::out::outln;
use cuda_ipc_bench::lines::LineReader;
use cuda_ipc_bench::mps;

/// How many frames the paced phase sends after the flat-out one.
pub const PACED_FRAMES: u64 = 200;
/// The pause before each paced frame: long enough for the consumer to have
/// taken and acknowledged the one before, so that none queues.
pub const PACE: Duration = Duration::from_micros(500);

/// The value of word `i` of frame `seq`.
fn frame_pattern(seq: u64) -> Pattern {
    Pattern::ramp(seq as u32, 1)
}

/// Checks what needs no GPU: the ring's shape and `--mps`'s company.
fn check_args(args: &Args) -> Result<(), Error> {
    if args.frame_size == 0 || !args.frame_size.is_multiple_of(4) || args.slots == 0 {
        return Err(Error::InvalidArgument {
            what: "stream",
            reason: format!(
                "--frame-size ({}) must be a positive multiple of 4 and --slots ({}) at least 1",
                args.frame_size, args.slots
            ),
        });
    }
    if args.mps && !args.consumer_namespaces.is_empty() {
        return Err(Error::InvalidArgument {
            what: "stream",
            reason: "--mps and --consumer-namespaces do not go together: an MPS client must \
                     reach the control daemon's pipe folder and share its IPC namespace; run \
                     them separately"
                .into(),
        });
    }
    Ok(())
}

pub fn run(args: &Args) -> Result<Outcome, Error> {
    check_args(args)?;
    if args.mps && !args.under_mps {
        return run_under_mps();
    }
    let namespaces = super::consumer_namespaces(&args.consumer_namespaces)?;
    let device = Device::open(args.device)?;
    // Whether this process's context goes through an MPS server: the
    // driver decided when it started.
    let mps = device.capabilities()?.mps;
    let publisher = Publisher::bind(
        &device,
        Endpoint::Name(format!("demo-{}", std::process::id())),
        PublisherConfig::default(),
    )?;
    let ring = publisher.ring(
        "frames",
        args.slots,
        args.frame_size as usize,
        args.mechanism.0,
    )?;
    let device_arg = args.device.to_string();
    let check_every = args.check_every.to_string();
    let mut child = super::spawn_self_in(
        &namespaces,
        "consumer",
        &[
            OsStr::new("__demo-consumer"),
            OsStr::new("--device"),
            OsStr::new(&device_arg),
            OsStr::new("--stream-socket"),
            publisher.path().as_os_str(),
            OsStr::new("--check-every"),
            OsStr::new(&check_every),
        ],
        Stdio::null(),
    )?;
    let from_child = LineReader::new(child.stdout.take().expect("piped"), "consumer process");
    wait_for_subscriber(&ring, &mut child)?;
    outln!(
        "cuda-ipc demo --stream: {} frames through a ring of {} buffers ({}) for {:.0?}",
        human(args.frame_size),
        args.slots,
        publisher
            .buffer("frames")
            .map_or_else(|| "ring".into(), |b| b.mechanism().to_string()),
        args.seconds
    )?;
    if !namespaces.is_empty() {
        outln!("  the consumer runs in new namespaces: {namespaces}")?;
    }
    if args.under_mps {
        outln!(
            "  both processes are clients of a private MPS control daemon ({}){}",
            std::env::var(mps::PIPE_VAR).unwrap_or_default(),
            match mps {
                Some(false) => "; but the driver says this process is NOT under MPS",
                _ => "",
            }
        )?;
    }
    let Streamed {
        seq,
        waiting,
        seconds,
        result: produced,
    } = stream_frames(&ring, args.seconds);
    drop(ring); // the consumer sees the end of the ring after the last frame
    let report = from_child.next(Duration::from_secs(60));
    let status = child.wait().map_err(|e| Error::Io {
        context: "waiting for the consumer".into(),
        source: e,
    })?;
    produced?;
    let report = report?;
    if let Some(e) = report.get("error") {
        return Err(Error::InvalidArgument {
            what: "consumer",
            reason: e.as_str().unwrap_or("failed").into(),
        });
    }
    let outcome = print_report(&report, seq, seconds, args.frame_size, status.success())?;
    // What the consumer's wake-up costs a lone frame here, measured now in
    // this process (no GPU; about 2 x WAKE_PROBE_SAMPLES x PACE).
    let wake = cuda_ipc_bench::wake_probe(PACE, cuda_ipc_bench::WAKE_PROBE_SAMPLES);
    outln!(
        "  {}",
        wake_line(wake.as_ref().map_err(ToString::to_string))
    )?;
    outln!(
        "  {}",
        what_limits(waiting.as_secs_f64() / seconds.max(1e-9), mps)
    )?;
    if let Some(note) = kernel_check_note(args.frame_size, args.check_every, mps) {
        outln!("  {note}")?;
    }
    Ok(outcome)
}

/// What the producer did: the last frame's sequence number, the time it
/// waited for a free buffer and the length of the flat-out phase (s), and
/// whether every frame went out.
struct Streamed {
    seq: u64,
    waiting: Duration,
    seconds: f64,
    result: Result<(), Error>,
}

/// The producer: frames flat out for `flat_out`, then [`PACED_FRAMES`]
/// frames [`PACE`] apart, each stamped with the time its writing began.
fn stream_frames(ring: &cuda_ipc::exchange::RingPublisher, flat_out: Duration) -> Streamed {
    let started = Instant::now();
    let mut seq = 0u64;
    // Time the producer spent waiting for a free buffer (the consumer's pace).
    let mut waiting = Duration::ZERO;
    let mut seconds = None;
    let result = (|| -> Result<(), Error> {
        let mut frame = |paced: bool| -> Result<Duration, Error> {
            let asked = Instant::now();
            let (slot, buffer) = ring.acquire(Some(Duration::from_secs(10)))?;
            let waited = asked.elapsed();
            let t_ns = mono_ns();
            kernels::fill_u32(buffer, frame_pattern(seq + 1), Speed::Full)?;
            let mut extra = serde_json::Map::new();
            extra.insert("t_ns".into(), t_ns.into());
            if paced {
                extra.insert("paced".into(), true.into());
            }
            seq = ring.publish_with(slot, extra)?;
            Ok(waited)
        };
        while started.elapsed() < flat_out {
            waiting += frame(false)?;
        }
        seconds = Some(started.elapsed().as_secs_f64());
        for _ in 0..PACED_FRAMES {
            std::thread::sleep(PACE);
            frame(true)?;
        }
        Ok(())
    })();
    Streamed {
        seq,
        waiting,
        seconds: seconds.unwrap_or_else(|| started.elapsed().as_secs_f64()),
        result,
    }
}

/// `--mps`: this demo again, both of its processes clients of a private
/// MPS control daemon, stopped when it ends (a watchdog stops it if we are
/// killed). Its exit code is the demo's.
fn run_under_mps() -> Result<Outcome, Error> {
    let mut daemon = mps::PrivateDaemon::start()?;
    let exe = std::env::current_exe().map_err(|e| Error::Io {
        context: "finding our own executable".into(),
        source: e,
    })?;
    let status = daemon
        .command(exe)
        .args(std::env::args_os().skip(1))
        .arg("--under-mps")
        .stdin(Stdio::null())
        .status()
        .map_err(|e| Error::Io {
            context: "starting the demo under MPS".into(),
            source: e,
        });
    let stopped = daemon.stop();
    let status = status?;
    if let Err(e) = stopped {
        return Err(Error::Io {
            context: "--mps: stopping the private MPS control daemon".into(),
            source: std::io::Error::other(e),
        });
    }
    Ok(match status.code() {
        Some(0) => Outcome::Ok,
        Some(c) => Outcome::Exit(u8::try_from(c).unwrap_or(crate::EXIT_FAILED)),
        None => Outcome::Exit(crate::EXIT_FAILED),
    })
}

/// What waking the consumer costs each lone frame on this machine: a
/// notice to a thread asleep for [`PACE`] (as the consumer is between
/// lone frames), and to one spinning.
fn wake_line(probe: Result<&cuda_ipc_bench::WakeProbe, String>) -> String {
    match probe {
        Ok(p) => format!(
            "a lone frame wakes the sleeping consumer: this machine wakes a thread asleep for \
             {:.1} ms in {:.1} us (p50 of {}; one spinning in {:.1} us), part of each lone \
             frame's latency above (`cuda-ipc info` says how its processors idle)",
            p.idle_ms,
            p.asleep_p50_ms * 1e3,
            p.samples,
            p.spinning_p50_ms * 1e3
        ),
        Err(e) => format!("the consumer's wake-up was not measured here: {e}"),
    }
}

/// What limits the stream, from the share of the time the producer waited
/// for a free buffer and whether its context goes through MPS.
fn what_limits(waiting_share: f64, mps: Option<bool>) -> String {
    let w = (waiting_share * 100.0).clamp(0.0, 100.0);
    let side = if w >= 50.0 {
        format!(
            "the consumer: the producer waited for a free buffer {w:.0}% of the time while the \
             consumer waited on each frame's event, checked the frame and acknowledged it"
        )
    } else {
        format!(
            "the producer: it spent {:.0}% of the time writing frames and publishing their \
             notices, {w:.0}% waiting for a free buffer",
            100.0 - w
        )
    };
    let gpu = match mps {
        Some(true) => "both processes are MPS clients, so no frame waits for a context switch",
        Some(false) => {
            "without MPS the two processes time-slice the GPU and frames wait for context \
             switches; --mps runs both under a private MPS daemon (`cuda-ipc info` says whether \
             one runs here)"
        }
        None => "the driver does not say whether MPS is in use (`cuda-ipc info`)",
    };
    format!("limited by {side}; {gpu}")
}

/// What the consumer's check kernels cost the figures, when there are
/// any: frames over [`HOST_CHECK_MAX`], checked one in `check_every`, by
/// a process that may not be an MPS client.
fn kernel_check_note(frame_size: u64, check_every: u64, mps: Option<bool>) -> Option<String> {
    if frame_size <= HOST_CHECK_MAX as u64 || mps == Some(true) {
        return None;
    }
    let which = if check_every <= 1 {
        "every frame".to_string()
    } else {
        format!("one frame in {check_every} and every lone one")
    };
    Some(format!(
        "the consumer checks {which} with a kernel (frames over {}); without MPS the \
         producer's next frame then waits for the GPU to switch contexts back (about 0.25 ms on \
         an H200), which these latencies include: --check-every N checks fewer frames, --mps \
         removes the switch",
        human(HOST_CHECK_MAX as u64)
    ))
}

/// Prints the stream's figures; whether every frame arrived intact.
fn print_report(
    report: &Value,
    seq: u64,
    seconds: f64,
    frame_size: u64,
    consumer_ok: bool,
) -> Result<Outcome, Error> {
    let frames = report["frames"].as_u64().unwrap_or(0);
    let bad = report["bad"].as_u64().unwrap_or(u64::MAX);
    let fps = report["load_frames"].as_u64().unwrap_or(0) as f64 / seconds;
    let checked = report["checked"].as_u64().unwrap_or(0);
    outln!(
        "  frames sent {seq}, received {frames} in order, {checked} checked value by value, \
         mismatched {bad}"
    )?;
    outln!(
        "  flat out: {fps:.0} frames/s, {:.2} GB/s of frames",
        fps * frame_size as f64 / 1e9
    )?;
    outln!(
        "  latency of a lone frame ({PACED_FRAMES} frames {} us apart), write start to usable \
         in the consumer: {}",
        PACE.as_micros(),
        latency(&report["paced_us"])
    )?;
    outln!(
        "  latency flat out, a frame waiting behind those queued before it: {}",
        latency(&report["load_us"])
    )?;
    if bad == 0 && frames == seq && consumer_ok {
        outln!(
            "OK: every frame arrived in order{}; no frame was copied between the processes",
            if checked == frames {
                ", intact"
            } else {
                "; every checked frame intact"
            }
        )?;
        Ok(Outcome::Ok)
    } else {
        outln!(
            "FAILED: {bad} mismatched frames, {} lost, consumer ok: {consumer_ok}",
            seq.saturating_sub(frames)
        )?;
        Ok(Outcome::Mismatch)
    }
}

/// `p50 .. us, p90 .. us, p99 .. us` of a consumer's `[p50, p90, p99]`.
fn latency(q: &Value) -> String {
    let at = |i: usize| q.get(i).and_then(Value::as_f64).unwrap_or(f64::NAN);
    format!(
        "p50 {:.1} us, p90 {:.1} us, p99 {:.1} us",
        at(0),
        at(1),
        at(2)
    )
}

/// Waits until the consumer has subscribed to the ring (or died).
fn wait_for_subscriber(
    ring: &cuda_ipc::exchange::RingPublisher,
    child: &mut std::process::Child,
) -> Result<(), Error> {
    let waited = Instant::now();
    while ring.subscribers().is_empty() {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(Error::InvalidArgument {
                what: "consumer",
                reason: format!("exited before subscribing ({status})"),
            });
        }
        if waited.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            return Err(Error::from(ChannelError::Timeout {
                what: "the consumer to subscribe".into(),
                after: Duration::from_secs(60),
            }));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// Frames up to this size are checked on the host, larger ones by a kernel.
const HOST_CHECK_MAX: usize = 64 << 10;

/// Whether every word of frame `seq` holds what the producer wrote.
///
/// Up to [`HOST_CHECK_MAX`] the frame is copied out and compared here: a
/// copy queues no kernel in this process's context. Without MPS a check
/// kernel in the consumer makes the producer's next fill wait for the GPU
/// to switch contexts back: on the H200 (2026-12-02) a kernel check of
/// every 4 KiB frame put a lone frame at 0.29 ms and held the stream to
/// 8,100 frames/s, where the copy gives 0.054 ms and 53,323 frames/s.
/// Copying larger frames to pageable memory costs more than the switch
/// (1 MiB: 2,048 frames/s against 7,670 with the kernel), so they are
/// checked by a kernel.
fn frame_intact(buffer: &cuda_ipc::MappedBuffer<u32>, seq: u64) -> Result<bool, Error> {
    let p = frame_pattern(seq);
    if buffer.byte_len() <= HOST_CHECK_MAX {
        let words: Vec<u32> = buffer.to_vec()?;
        Ok(words.iter().zip(0u64..).all(|(w, i)| *w == p.at(i)))
    } else {
        Ok(kernels::check_u32(buffer, p)?.is_none())
    }
}

/// `[p50, p90, p99]` of `v` (NaN where empty).
fn percentiles(mut v: Vec<f64>) -> [f64; 3] {
    v.sort_by(f64::total_cmp);
    [0.5, 0.9, 0.99].map(|q| quantile(&v, q))
}

/// The value at quantile `q` of sorted `v`.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub fn consumer(
    device: usize,
    socket: &std::path::Path,
    check_every: u64,
) -> Result<Outcome, Error> {
    let result = (|| -> Result<Value, Error> {
        let device = Device::open(device)?;
        let sub = Subscriber::connect(&device, socket, SubscriberConfig::default())?;
        let ring = sub.attach_ring::<u32>("frames")?;
        let (mut frames, mut bad, mut expected, mut checked) = (0u64, 0u64, 1u64, 0u64);
        let (mut load, mut lone) = (Vec::new(), Vec::new());
        loop {
            let frame = match sub.next_frame(&ring, Duration::from_secs(30)) {
                Ok(f) => f,
                Err(Error::Channel(ChannelError::Unpublished { .. })) => break,
                Err(e) => return Err(e),
            };
            // Usable: the stream waited on the frame's event (or fence).
            frame.buffer.synchronize()?;
            let usable = mono_ns();
            let paced = frame.notice["paced"].as_bool() == Some(true);
            let check = paced || frames.is_multiple_of(check_every.max(1));
            if frame.seq != expected || (check && !frame_intact(&frame.buffer, frame.seq)?) {
                bad += 1;
            }
            checked += u64::from(check);
            expected = frame.seq + 1;
            if let Some(t) = frame.notice["t_ns"].as_u64() {
                let us = usable.saturating_sub(t) as f64 / 1e3;
                if paced {
                    lone.push(us);
                } else {
                    load.push(us);
                }
            }
            frames += 1;
            sub.ack(&ring, frame)?;
        }
        sub.release_ring(ring)?;
        Ok(json!({
            "frames": frames,
            "checked": checked,
            "load_frames": load.len(),
            "bad": bad,
            "load_us": percentiles(load),
            "paced_us": percentiles(lone),
        }))
    })();
    let v = result.unwrap_or_else(|e| json!({ "error": e.to_string() }));
    outln!("{v}")?;
    Ok(Outcome::Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5).to_bits(), 51f64.to_bits());
        assert_eq!(quantile(&v, 0.0).to_bits(), 1f64.to_bits());
        assert_eq!(quantile(&v, 1.0).to_bits(), 100f64.to_bits());
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn the_limit_names_the_slower_side_and_mps() {
        let busy = what_limits(0.8, Some(false));
        assert!(busy.starts_with("limited by the consumer"), "{busy}");
        assert!(busy.contains("80%") && busy.contains("--mps"), "{busy}");
        let fast = what_limits(0.1, Some(true));
        assert!(
            fast.starts_with("limited by the producer: it spent 90%"),
            "{fast}"
        );
        assert!(
            fast.contains("MPS clients") && !fast.contains("--mps"),
            "{fast}"
        );
        assert!(what_limits(f64::NAN, None).contains("does not say"));
        assert!(what_limits(3.0, None).contains("100%"));
    }

    #[test]
    fn latencies_print_three_quantiles_and_say_nan_for_none() {
        assert_eq!(
            latency(&json!([12.34, 20.0, 99.96])),
            "p50 12.3 us, p90 20.0 us, p99 100.0 us"
        );
        // No frames of a kind: the consumer's NaNs arrive as nulls.
        let none = json!({ "paced_us": percentiles(Vec::new()) });
        assert_eq!(
            latency(&none["paced_us"]),
            "p50 NaN us, p90 NaN us, p99 NaN us"
        );
        assert_eq!(
            latency(&json!("garbage")),
            "p50 NaN us, p90 NaN us, p99 NaN us"
        );
        let q = percentiles((1..=100).rev().map(f64::from).collect());
        assert_eq!(q.map(f64::to_bits), [51.0, 90.0, 99.0].map(f64::to_bits));
    }

    #[test]
    fn kernel_checks_are_named_where_they_cost_a_context_switch() {
        // Small frames are checked on the host: nothing to say.
        assert_eq!(kernel_check_note(4096, 1, Some(false)), None);
        assert_eq!(kernel_check_note(64 << 10, 1, None), None);
        // Under MPS there is no switch to wait for.
        assert_eq!(kernel_check_note(1 << 20, 1, Some(true)), None);
        let every = kernel_check_note(1 << 20, 1, Some(false)).unwrap();
        assert!(
            every.contains("checks every frame with a kernel"),
            "{every}"
        );
        assert!(
            every.contains("--check-every N") && every.contains("--mps"),
            "{every}"
        );
        let some = kernel_check_note((64 << 10) + 4, 1024, None).unwrap();
        assert!(
            some.contains("checks one frame in 1024 and every lone one"),
            "{some}"
        );
    }

    #[test]
    fn the_wake_line_says_the_wake_up_and_its_idle_time() {
        let p = cuda_ipc_bench::WakeProbe {
            idle_ms: 0.5,
            samples: 21,
            asleep_p50_ms: 0.0312,
            asleep: 21,
            spinning_p50_ms: 0.0007,
        };
        let line = wake_line(Ok(&p));
        assert!(
            line.contains("asleep for 0.5 ms in 31.2 us (p50 of 21; one spinning in 0.7 us)"),
            "{line}"
        );
        let failed = wake_line(Err("no eventfd".into()));
        assert!(
            failed.ends_with("not measured here: no eventfd"),
            "{failed}"
        );
    }

    #[test]
    fn frames_have_distinct_patterns() {
        assert_ne!(frame_pattern(1).at(0), frame_pattern(2).at(0));
        assert_eq!(frame_pattern(7).at(3), 10);
    }
}
