//! What one user's ring subscribers may cost the others: a stall budget
//! per user and ring ([`StallBudget`]), and the per-user budget of the
//! server's processor time that every connection's reader draws on
//! ([`CpuBudget`]).
//!
//! Both are token buckets: a balance that refills at a fixed rate (a
//! share of the time) up to a cap (the burst), drawn on by what the user
//! costs, and that may go below zero. A user in debt is the one that
//! waits: its late subscribers are skipped or evicted at once, its
//! readers sleep until the balance is back. So the bound holds over time,
//! however the user spreads its cost over stalls, connections or
//! subscriptions, and whatever it does in between (an ack, a new
//! subscription or a new connection does not refill anything).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{ChannelError, lock};

/// How long the subscribers of one user (uid) may hold up a ring's
/// producer while subscribers of another user subscribe to it too.
///
/// Every ring has one (by default [`StallBudget::DEFAULT`]; see
/// [`ServerRing::set_stall_budget`](crate::ServerRing::set_stall_budget)).
/// When the producer waits for a slot that a subscriber has not acked,
/// the wait is charged to that subscriber's user, until it acks; a user
/// whose budget is spent is late at once, and its subscriber is skipped
/// or evicted by the ring's [`LatePolicy`](crate::LatePolicy). A ring
/// whose subscribers all belong to one user is not charged: their
/// back-pressure on the producer is what the ring is for, and they harm
/// nobody else.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct StallBudget {
    /// The share of the time, over the long run, that one user may hold
    /// up the producer (above 0, at most 1).
    pub share: f64,
    /// The longest stall a user with an untouched budget may cause at
    /// once (the bucket's size).
    pub burst: Duration,
}

impl StallBudget {
    /// The default: 5 % of the time, stalls of up to half a second at
    /// once (a subscriber's slow first frame, a pause of its process).
    pub const DEFAULT: StallBudget = StallBudget {
        share: 0.05,
        burst: Duration::from_millis(500),
    };

    /// A budget of `share` of the time (above 0, at most 1) with stalls of
    /// up to `burst` (above zero, at most an hour) at once.
    pub fn new(share: f64, burst: Duration) -> Result<StallBudget, ChannelError> {
        check_share("stall budget share", share)?;
        check_burst("stall budget burst", burst)?;
        Ok(StallBudget { share, burst })
    }
}

impl Default for StallBudget {
    fn default() -> Self {
        StallBudget::DEFAULT
    }
}

/// How much of the server's processor time the connections of one user
/// (uid) other than the server's own may take: each connection's reader
/// measures the processor time it spends on what the client sends
/// (receiving, decoding and answering its messages, applying its acks)
/// and charges it to the client's user; a user in debt has its readers
/// sleep, not reading their sockets, until its balance is back, so a
/// flood costs the server that share and no more, however many
/// connections carry it. See
/// [`ServerConfig::peer_cpu_budget`](crate::ServerConfig::peer_cpu_budget).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct CpuBudget {
    /// The share of one core, over the long run, that one user's
    /// connections may take (above 0, at most 64).
    pub share: f64,
    /// How much processor time a user with an untouched budget may take
    /// at once.
    pub burst: Duration,
}

impl CpuBudget {
    /// The default: a quarter of one core, 50 ms at once. Serving an
    /// attach takes the server tens of microseconds and an ack about one,
    /// so this leaves room for thousands of attaches and hundreds of
    /// thousands of acks a second from one user.
    pub const DEFAULT: CpuBudget = CpuBudget {
        share: 0.25,
        burst: Duration::from_millis(50),
    };

    /// A budget of `share` of one core (above 0, at most 64) with up to
    /// `burst` (above zero, at most an hour) at once.
    pub fn new(share: f64, burst: Duration) -> Result<CpuBudget, ChannelError> {
        if !(share > 0.0 && share <= 64.0) {
            return Err(ChannelError::arg(
                "cpu budget share",
                format!("{share} is not a share of one core above 0 and at most 64"),
            ));
        }
        check_burst("cpu budget burst", burst)?;
        Ok(CpuBudget { share, burst })
    }
}

impl Default for CpuBudget {
    fn default() -> Self {
        CpuBudget::DEFAULT
    }
}

fn check_share(what: &'static str, share: f64) -> Result<(), ChannelError> {
    if share > 0.0 && share <= 1.0 {
        Ok(())
    } else {
        Err(ChannelError::arg(
            what,
            format!("{share} is not a share of the time above 0 and at most 1"),
        ))
    }
}

fn check_burst(what: &'static str, burst: Duration) -> Result<(), ChannelError> {
    if burst.is_zero() || burst > Duration::from_secs(3600) {
        return Err(ChannelError::arg(
            what,
            format!("{burst:?} is not above zero and at most an hour"),
        ));
    }
    Ok(())
}

/// A token bucket of seconds: refills at `share` seconds a second up to
/// `burst`, drawn on by charges, may go below zero.
#[derive(Clone, Copy, Debug)]
pub(super) struct Bucket {
    /// Seconds left at `at`.
    balance: f64,
    at: Instant,
}

impl Bucket {
    /// A full bucket.
    pub(super) fn full(burst: Duration, now: Instant) -> Bucket {
        Bucket {
            balance: burst.as_secs_f64(),
            at: now,
        }
    }

    /// The balance at `now` (seconds; negative: in debt).
    pub(super) fn balance(&self, share: f64, burst: Duration, now: Instant) -> f64 {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * share;
        (self.balance + refill).min(burst.as_secs_f64())
    }

    /// Draws `cost` at `now`.
    pub(super) fn charge(&mut self, share: f64, burst: Duration, now: Instant, cost: Duration) {
        self.balance = self.balance(share, burst, now) - cost.as_secs_f64();
        self.at = now;
    }

    /// How long from `now` until the balance is back to zero (zero if it
    /// is not in debt).
    pub(super) fn debt_left(&self, share: f64, burst: Duration, now: Instant) -> Duration {
        let balance = self.balance(share, burst, now);
        if balance >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((-balance / share).min(3600.0))
        }
    }
}

/// The processor time this thread has used.
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The longest a throttled reader sleeps before it looks at its
/// connection again (so that a connection closed meanwhile, or a server
/// shutting down, is not kept waiting).
const THROTTLE_SLICE: Duration = Duration::from_millis(20);

/// A connection reader's meter: charges the processor time the reader
/// thread spends on its client to the client's user ([`CpuBudget`]).
pub(super) struct CpuMeter {
    budget: CpuBudget,
    /// The user's account, shared by all its connections.
    account: Arc<Mutex<Bucket>>,
    /// The thread's processor time at the last charge.
    last: Duration,
}

impl CpuMeter {
    /// A meter drawing on `account` from now on.
    pub(super) fn new(budget: CpuBudget, account: Arc<Mutex<Bucket>>) -> CpuMeter {
        CpuMeter {
            budget,
            account,
            last: thread_cpu(),
        }
    }

    /// Charges the processor time this thread used since the last call
    /// (its spins for the client's next message included: the client's
    /// messages are what make it spin), then, if the user is in
    /// debt, sleeps (in slices, as long as `open` says the connection is
    /// served) until its balance is back to a quarter of its burst, so
    /// that a throttled reader wakes for a batch of work rather than for
    /// each message (each wake-up costs too, and is charged). Returns how
    /// long it slept.
    pub(super) fn charge_and_wait(&mut self, open: impl Fn() -> bool) -> Duration {
        let now_cpu = thread_cpu();
        let used = now_cpu.saturating_sub(self.last);
        self.last = now_cpu;
        let CpuBudget { share, burst } = self.budget;
        let now = Instant::now();
        let debt = {
            let mut a = lock(&self.account);
            a.charge(share, burst, now, used);
            a.debt_left(share, burst, now)
        };
        if debt.is_zero() {
            return Duration::ZERO;
        }
        let until = now + debt + Duration::from_secs_f64(burst.as_secs_f64() / 4.0 / share);
        let mut slept = Duration::ZERO;
        while open() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let nap = left.min(THROTTLE_SLICE);
            std::thread::sleep(nap);
            slept += nap;
        }
        slept
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_refills_at_its_share_up_to_its_burst() {
        let t0 = Instant::now();
        let burst = Duration::from_millis(100);
        let mut b = Bucket::full(burst, t0);
        assert!((b.balance(0.1, burst, t0) - 0.1).abs() < 1e-9);
        // 300 ms drawn: 200 ms in debt, 2 s at 10 % to pay it back.
        b.charge(0.1, burst, t0, Duration::from_millis(300));
        assert!((b.balance(0.1, burst, t0) + 0.2).abs() < 1e-9);
        let left = b.debt_left(0.1, burst, t0);
        assert!((left.as_secs_f64() - 2.0).abs() < 1e-6, "{left:?}");
        let t1 = t0 + Duration::from_secs(1);
        assert!((b.balance(0.1, burst, t1) + 0.1).abs() < 1e-9);
        // Never above the burst, however long it rests.
        let t2 = t0 + Duration::from_secs(3600);
        assert!((b.balance(0.1, burst, t2) - 0.1).abs() < 1e-9);
        assert_eq!(b.debt_left(0.1, burst, t2), Duration::ZERO);
    }

    #[test]
    fn budgets_refuse_what_is_out_of_range() {
        assert!(StallBudget::new(0.0, Duration::from_secs(1)).is_err());
        assert!(StallBudget::new(1.5, Duration::from_secs(1)).is_err());
        assert!(StallBudget::new(f64::NAN, Duration::from_secs(1)).is_err());
        assert!(StallBudget::new(0.1, Duration::ZERO).is_err());
        let e = StallBudget::new(0.1, Duration::from_secs(7200)).unwrap_err();
        assert!(e.to_string().contains("at most an hour"), "{e}");
        assert_eq!(
            StallBudget::new(0.05, Duration::from_millis(500)).unwrap(),
            StallBudget::DEFAULT
        );
        assert!(CpuBudget::new(0.0, Duration::from_millis(1)).is_err());
        assert!(CpuBudget::new(2.0, Duration::from_millis(1)).is_ok());
    }

    /// Burns about `d` of this thread's processor time.
    fn burn(d: Duration) {
        let start = thread_cpu();
        while thread_cpu().saturating_sub(start) < d {
            std::hint::black_box(0u64.wrapping_add(1));
        }
    }

    #[test]
    fn a_meter_charges_its_threads_work_and_sleeps_off_the_debt() {
        let budget = CpuBudget::new(0.5, Duration::from_millis(10)).unwrap();
        let account = Arc::new(Mutex::new(Bucket::full(budget.burst, Instant::now())));
        let mut m = CpuMeter::new(budget, Arc::clone(&account));
        // 5 ms of work within a 10 ms burst: no sleep.
        burn(Duration::from_millis(5));
        assert_eq!(m.charge_and_wait(|| true), Duration::ZERO);
        // 25 ms of work against a balance refilled meanwhile to the 10 ms
        // burst: 15 ms in debt at half a core (30 ms to pay back), then a
        // quarter of the burst to gain (5 ms): about 35 ms asleep.
        burn(Duration::from_millis(25));
        let slept = m.charge_and_wait(|| true);
        assert!(
            slept >= Duration::from_millis(25) && slept < Duration::from_millis(200),
            "{slept:?}"
        );
        // Two meters of one user share the account: the second one's work
        // puts the first in debt too.
        let mut other = CpuMeter::new(budget, Arc::clone(&account));
        burn(Duration::from_millis(40));
        assert!(other.charge_and_wait(|| false) == Duration::ZERO);
        let now = Instant::now();
        assert!(lock(&account).debt_left(budget.share, budget.burst, now) > Duration::ZERO);
        assert!(m.charge_and_wait(|| true) > Duration::ZERO);
    }
}
