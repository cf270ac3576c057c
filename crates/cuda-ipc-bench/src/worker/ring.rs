//! The consumer's side of a ring: the `ring` request (waits on the
//! publisher's events) and `sync_ring` (a sync mode and a batch), and the
//! account of the frames both keep.

use cuda_ipc::exchange::{RingFrame, Subscriber};
use cuda_ipc::kernels::Pattern;
use cuda_ipc::{DeviceMemory, Error};
use serde_json::{Value, json};

use super::{State, WAIT, int, text, verify};
use crate::proto::{failure, get_u64, mono_ns, send_line};
use crate::stats::ns_to_ms;

impl State {
    pub(super) fn ring(&self, r: &Value, out: &mut impl std::io::Write) -> Result<Value, Error> {
        let name = text(r, "name")?;
        let verify_every = int(r, "verify_every")?.max(1);
        let sub = self.sub()?;
        let ring = sub.attach_ring::<u32>(name)?;
        send_line(out, &json!({ "subscribed": true }))?;
        let mut tally = RingTally::new(verify_every);
        let result = (|| -> Result<(), Error> {
            loop {
                let frame = sub.next_frame(&ring, WAIT)?;
                if frame.notice.get("stop").and_then(Value::as_bool) == Some(true) {
                    sub.ack(&ring, frame)?;
                    return Ok(());
                }
                frame.buffer.synchronize()?;
                tally.record(&frame, mono_ns())?;
                sub.ack(&ring, frame)?;
            }
        })();
        let released = sub.release_ring(ring);
        result?;
        released?;
        Ok(tally.answer())
    }
}

/// A ring consumer's account of the frames it took: latencies under load
/// and paced, the load phase's first and last arrival, sequence gaps, and
/// the checks of every `verify_every`-th frame (and every paced one).
pub(crate) struct RingTally {
    verify_every: u64,
    load: Vec<f64>,
    paced: Vec<f64>,
    first_ns: u64,
    last_ns: u64,
    frames: u64,
    checked: u64,
    bad: u64,
    first_bad: Option<String>,
    expected_seq: Option<u64>,
    gaps: u64,
}

impl RingTally {
    pub(crate) fn new(verify_every: u64) -> Self {
        RingTally {
            verify_every: verify_every.max(1),
            load: Vec::new(),
            paced: Vec::new(),
            first_ns: 0,
            last_ns: 0,
            frames: 0,
            checked: 0,
            bad: 0,
            first_bad: None,
            expected_seq: None,
            gaps: 0,
        }
    }

    /// Counts `frame`, synchronised and seen at `t` (CLOCK_MONOTONIC ns).
    pub(crate) fn record(&mut self, frame: &RingFrame<u32>, t: u64) -> Result<(), Error> {
        let is_paced = frame.notice.get("p").and_then(Value::as_u64) == Some(1);
        let t_pub = frame
            .notice
            .get("t")
            .and_then(Value::as_u64)
            .ok_or_else(|| failure("a ring frame", "no time stamp in its notice"))?;
        if self.expected_seq.is_some_and(|s| s != frame.seq) {
            self.gaps += 1;
        }
        self.expected_seq = Some(frame.seq + 1);
        let latency = ns_to_ms(t_pub, t);
        if is_paced {
            self.paced.push(latency);
        } else {
            if self.load.is_empty() {
                self.first_ns = t;
            }
            self.last_ns = t;
            self.load.push(latency);
        }
        self.frames += 1;
        if is_paced || (self.frames - 1).is_multiple_of(self.verify_every) {
            self.checked += 1;
            if let Some(m) = verify(&frame.buffer, Pattern::ramp(frame.seq as u32, 1))? {
                self.bad += 1;
                self.first_bad
                    .get_or_insert(format!("frame {}: {m}", frame.seq));
            }
        }
        Ok(())
    }

    /// The answer to the producer.
    pub(crate) fn answer(self) -> Value {
        json!({
            "load_ms": self.load,
            "paced_ms": self.paced,
            "load_frames": self.load.len() as u64,
            "first_ns": self.first_ns,
            "last_ns": self.last_ns,
            "checked": self.checked,
            "bad": self.bad,
            "first_bad": self.first_bad,
            "gaps": self.gaps,
        })
    }
}

/// The consumer's side of a ring run (the worker's `sync_ring` request):
/// takes up to `batch` frames under load (a paced or the stop frame ends a
/// batch early), synchronizes once per batch, then checks and acks them.
/// Answers as the worker's `ring` request does, plus whether it waited on
/// fences.
pub fn consume_ring(
    sub: &Subscriber,
    r: &Value,
    out: &mut impl std::io::Write,
) -> Result<Value, Error> {
    let name = r["name"]
        .as_str()
        .ok_or_else(|| failure("sync_ring", "the request has no \"name\""))?;
    let batch = get_u64(r, "batch")?.max(1);
    let verify_every = get_u64(r, "verify_every")?.max(1);
    let ring = sub.attach_ring::<u32>(name)?;
    send_line(
        out,
        &json!({ "subscribed": true, "fence": ring.uses_fences() }),
    )?;
    let mut tally = RingTally::new(verify_every);
    let result = (|| -> Result<(), Error> {
        loop {
            let mut taken = Vec::with_capacity(batch as usize);
            let mut stop = false;
            while (taken.len() as u64) < batch {
                let frame = sub.next_frame(&ring, WAIT)?;
                let flag = |k: &str| frame.notice.get(k);
                stop = flag("stop").and_then(Value::as_bool) == Some(true);
                let is_paced = flag("p").and_then(Value::as_u64) == Some(1);
                taken.push(frame);
                if stop || is_paced {
                    break;
                }
            }
            // One synchronize for the batch: the first waits for the GPU,
            // the others find their streams idle.
            for f in &taken {
                f.buffer.synchronize()?;
            }
            let t = mono_ns();
            for frame in taken {
                if frame.notice.get("stop").and_then(Value::as_bool) == Some(true) {
                    sub.ack(&ring, frame)?;
                    continue;
                }
                tally.record(&frame, t)?;
                sub.ack(&ring, frame)?;
            }
            if stop {
                return Ok(());
            }
        }
    })();
    let released = sub.release_ring(ring);
    result?;
    released?;
    Ok(tally.answer())
}
