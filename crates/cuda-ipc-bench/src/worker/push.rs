//! The consumer's side of the push section: subscribing to the producer's
//! stream, and taking a pushed block (`push_take`: says it waits, then
//! takes the next pushed set, synchronises, checks and releases it).

use std::time::{Duration, Instant};

use cuda_ipc::Error;
use cuda_ipc::exchange::{Subscriber, SubscriberConfig};
use serde_json::{Value, json};

use super::{State, check_set, failure, mono_ns, pattern, send_line, text};

/// How long a take waits for its block.
const TAKE_TIMEOUT: Duration = Duration::from_secs(60);

impl State {
    /// Connects again with a subscriber that polls `spin_us` before it
    /// sleeps (to the same socket).
    pub(super) fn respin(&mut self, r: &Value) -> Result<Value, Error> {
        let spin = Duration::from_micros(super::int(r, "spin_us")?);
        let socket = self
            .socket
            .clone()
            .ok_or_else(|| failure("respin", "not connected"))?;
        self.stream = None;
        self.sub = Some(Subscriber::connect(
            &self.device,
            std::path::Path::new(&socket),
            SubscriberConfig::default()
                .with_timeout(Duration::from_secs(60))
                .with_spin(spin),
        )?);
        Ok(json!({ "ok": true }))
    }

    pub(super) fn push_subscribe(&mut self, r: &Value) -> Result<Value, Error> {
        let stream = self.sub()?.subscribe(text(r, "stream")?)?;
        self.stream = Some(stream);
        Ok(json!({ "ok": true }))
    }

    pub(super) fn push_take(
        &self,
        r: &Value,
        t_recv: u64,
        out: &mut impl std::io::Write,
    ) -> Result<Value, Error> {
        let p = pattern(r)?;
        let sub = self.sub()?;
        let stream = self
            .stream
            .as_ref()
            .ok_or_else(|| failure("push_take", "not subscribed (push_subscribe first)"))?;
        send_line(out, &json!({ "waiting": true }))?;
        let set = sub.next_pushed_set(stream, TAKE_TIMEOUT)?;
        self.device
            .stream()
            .synchronize()
            .map_err(|e| failure("cuStreamSynchronize", format!("{e:?}")))?;
        let t_done = mono_ns();
        let checked = Instant::now();
        let bad = check_set(&set, p);
        let verify_ms = checked.elapsed().as_secs_f64() * 1e3;
        sub.release_set(set)?;
        bad?;
        Ok(json!({ "t_recv": t_recv, "t_done": t_done, "verify_ms": verify_ms }))
    }
}
