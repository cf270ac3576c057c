//! The stall budget's decisions on a ring's slots, with leases of two
//! users (the integration tests need root to run a second user; these
//! need nothing).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::conn::SlotSource;
use super::ring::{Late, late_on_slot};
use super::stall::StallBudget;
use super::state::{LatePolicy, Lease, Ring, SlotState};

const FAST: u64 = 1;
const LAGGARD: u64 = 2;
const FAST_UID: u32 = 1000;
const LAGGARD_UID: u32 = 2000;

fn source() -> SlotSource {
    SlotSource {
        meta: serde_json::Value::Null,
        fds: Vec::new(),
    }
}

fn lease(uid: u32) -> Lease {
    Lease {
        entry: 1,
        conn: 1,
        pid: 1,
        uid,
        skips: 0,
        via: None,
    }
}

/// A ring of `slots` slots with a stall budget of 10 % and 40 ms bursts,
/// and the leases of a fast subscriber and a laggard of users `fast` and
/// `laggard`.
fn ring(slots: usize, laggard: u32) -> (Ring, BTreeSet<u64>, HashMap<u64, Lease>) {
    let mut ring = Ring::new(Arc::from((0..slots).map(|_| source()).collect::<Vec<_>>()));
    ring.stall_budget = Some(StallBudget::new(0.1, Duration::from_millis(40)).unwrap());
    let subscribers = BTreeSet::from([FAST, LAGGARD]);
    let leases = HashMap::from([(FAST, lease(FAST_UID)), (LAGGARD, lease(laggard))]);
    for l in leases.values() {
        *ring.users.entry(l.uid).or_default() += 1;
    }
    (ring, subscribers, leases)
}

/// Slot `i` published, waiting for the laggard alone (the fast one acked).
fn in_flight(ring: &mut Ring, i: usize) {
    let s = &mut ring.slots[i];
    s.state = SlotState::InFlight;
    s.sent_at = Instant::now();
    s.waited_since = None;
    s.pending = BTreeSet::from([LAGGARD]);
}

fn late(ring: &mut Ring, i: usize, subs: &BTreeSet<u64>, all: &HashMap<u64, Lease>) -> Late {
    assert_eq!(
        subs.len(),
        ring.users.values().sum::<usize>(),
        "the users' count"
    );
    late_on_slot(ring, i, all, "r")
}

#[test]
fn another_users_laggard_is_late_once_its_burst_is_spent() {
    let (mut r, subs, all) = ring(2, LAGGARD_UID);
    in_flight(&mut r, 0);
    // Its budget is untouched: it may hold the producer up for a burst.
    let Late::At(due) = late(&mut r, 0, &subs, &all) else {
        panic!("a laggard with its whole budget is late at once");
    };
    let left = due.saturating_duration_since(Instant::now());
    assert!(left > Duration::from_millis(30), "{left:?}");
    std::thread::sleep(left + Duration::from_millis(5));
    let Late::Now(leases, LatePolicy::Skip) = late(&mut r, 0, &subs, &all) else {
        panic!("the laggard outlived its burst");
    };
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].0, LAGGARD);
    assert!(leases[0].1.contains("user 2000"), "{}", leases[0].1);
    assert!(leases[0].1.contains("10 % of the time"), "{}", leases[0].1);
    // The slot is free for the producer, and the stall was charged.
    assert_eq!(r.slots[0].state, SlotState::Free);
    assert!(r.slots[0].pending.is_empty());
    // In debt now: its subscribers get no frames (publish leaves them out)
    // on a ring others subscribe to, and the next slot it holds makes it
    // late at once, however it behaved in between.
    assert!(r.in_stall_debt(LAGGARD_UID, Instant::now(), true));
    assert!(!r.in_stall_debt(LAGGARD_UID, Instant::now(), false));
    assert!(!r.in_stall_debt(FAST_UID, Instant::now(), true));
    in_flight(&mut r, 1);
    assert!(matches!(late(&mut r, 1, &subs, &all), Late::Now(..)));
}

#[test]
fn subscribers_of_one_user_alone_hold_the_ring_as_long_as_they_like() {
    // The laggard belongs to the fast one's user: back-pressure, not harm.
    let (mut r, subs, all) = ring(1, FAST_UID);
    in_flight(&mut r, 0);
    assert!(matches!(late(&mut r, 0, &subs, &all), Late::Never));
    std::thread::sleep(Duration::from_millis(60));
    assert!(matches!(late(&mut r, 0, &subs, &all), Late::Never));
    assert_eq!(r.slots[0].state, SlotState::InFlight);
    assert!(r.stalls.is_empty());
}

#[test]
fn acks_that_come_late_spend_the_budget_across_subscriptions() {
    // A laggard that acks just in time, over and over (each ack would have
    // reset a count of skips): the stalls add up, and a new subscription
    // of the same user starts in the same debt.
    let (mut r, subs, all) = ring(1, LAGGARD_UID);
    for _ in 0..3 {
        in_flight(&mut r, 0);
        // (A slow machine may stretch a stall past what is left already.)
        if matches!(late(&mut r, 0, &subs, &all), Late::Now(..)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(15));
        // Its ack: charged from when the producer began to wait.
        let began = r.slots[0].waited_since.unwrap();
        r.charge_stall(LAGGARD_UID, began, Instant::now(), true);
    }
    // 45 ms charged against a 40 ms burst (refilled by 10 % of ~45 ms).
    let mut all = all;
    all.insert(3, lease(LAGGARD_UID));
    let subs: BTreeSet<u64> = [FAST, 3].into();
    let s = &mut r.slots[0];
    s.state = SlotState::InFlight;
    s.waited_since = None;
    s.pending = BTreeSet::from([3]);
    assert!(matches!(late(&mut r, 0, &subs, &all), Late::Now(..)));
}

#[test]
fn an_ack_deadline_applies_to_every_user_and_budgets_can_be_turned_off() {
    let (mut r, subs, all) = ring(1, FAST_UID);
    r.ack_deadline = Some(Duration::from_millis(10));
    r.late_policy = LatePolicy::Evict;
    in_flight(&mut r, 0);
    assert!(matches!(late(&mut r, 0, &subs, &all), Late::At(_)));
    std::thread::sleep(Duration::from_millis(15));
    let Late::Now(leases, LatePolicy::Evict) = late(&mut r, 0, &subs, &all) else {
        panic!("past its ack deadline, not late");
    };
    assert!(
        leases[0].1.contains("ack deadline of 10ms"),
        "{}",
        leases[0].1
    );
    // No deadline and no budget: another user's laggard is waited for.
    let (mut r, subs, all) = ring(1, LAGGARD_UID);
    r.stall_budget = None;
    in_flight(&mut r, 0);
    std::thread::sleep(Duration::from_millis(50));
    assert!(matches!(late(&mut r, 0, &subs, &all), Late::Never));
}
