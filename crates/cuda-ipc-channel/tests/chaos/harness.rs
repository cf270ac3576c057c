//! The harness: a reproducible generator, the descriptors this process
//! holds, the producer's side of the consumer rounds and the client
//! threads of the producer rounds.

use super::*;

// ---------------------------------------------------------------------------
// Randomness, reproducible from a printed seed

/// SplitMix64: small, fast, and enough to pick scenarios and delays.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn from_env(test: &str) -> Rng {
        let seed = if let Ok(s) = std::env::var("CUDA_IPC_CHAOS_SEED") {
            s.parse()
                .unwrap_or_else(|_| panic!("CUDA_IPC_CHAOS_SEED={s:?} is not a u64"))
        } else {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            (now.as_nanos() as u64) ^ u64::from(std::process::id()).rotate_left(32)
        };
        println!("{test}: chaos seed {seed} (replay with CUDA_IPC_CHAOS_SEED={seed})");
        Rng(seed)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub(crate) fn millis(&mut self, max: u64) -> Duration {
        Duration::from_micros(self.below(max * 1000 + 1))
    }
}

pub(crate) fn scale() -> usize {
    std::env::var("CUDA_IPC_CHAOS_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
}

// ---------------------------------------------------------------------------
// Memory and descriptors

/// The stamp a ring frame's notice announces, written at offset 0 of its slot.
pub(crate) fn stamp_of(fd: impl AsFd) -> u64 {
    let bytes = read_fd(fd, 8);
    u64::from_le_bytes(
        bytes
            .try_into()
            .unwrap_or_else(|b: Vec<u8>| panic!("a ring slot of {} bytes has no stamp", b.len())),
    )
}

pub(crate) fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Waits (up to 5 s) for the count of open descriptors to come back to
/// `expected`: a server thread closes a dead client's socket, and a reader
/// thread a dead child's pipe, a moment after the death is noticed.
/// The number of open descriptors once it has stopped changing (the same
/// for 100 ms; at most 5 s): a baseline taken while a connection's
/// descriptors are still being closed would count them (a run once
/// counted one more at its baseline than after its first round).
pub(crate) fn stable_fds() -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut last = open_fds();
    let mut since = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(5));
        let n = open_fds();
        if n != last {
            last = n;
            since = Instant::now();
        } else if since.elapsed() >= Duration::from_millis(100) || Instant::now() >= deadline {
            return n;
        }
    }
}

pub(crate) fn settle_fds(expected: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = open_fds();
        if n == expected || Instant::now() >= deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub(crate) fn entry_seed(name: &str) -> u8 {
    match name {
        "base" => 1,
        "extra" => 2,
        v => 10 + v.trim_start_matches('v').parse::<u8>().unwrap(),
    }
}

pub(crate) fn victim_entry(i: u64) -> String {
    format!("v{}", i % VICTIM_ENTRIES as u64)
}

// ---------------------------------------------------------------------------
// Consumers killed

/// What a victim does when it is killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Scenario {
    /// Half-way through a hello, or through a request after the handshake.
    MidFrame,
    /// In attach/release cycles, at a random moment.
    MidAttach,
    /// Sent a ring frame, not acked.
    MidRing,
    /// Acking a burst of ring frames, at a random moment.
    RingBurst,
    /// Holding leases on entries and the ring.
    HoldingLeases,
}

pub(crate) const SCENARIOS: [Scenario; 5] = [
    Scenario::MidFrame,
    Scenario::MidAttach,
    Scenario::MidRing,
    Scenario::RingBurst,
    Scenario::HoldingLeases,
];

/// The producer's side: the server, its ring, and a writable duplicate of
/// every slot's memfd.
pub(crate) struct Producer {
    pub(crate) server: Server,
    pub(crate) ring: ServerRing,
    pub(crate) slot_fds: Vec<OwnedFd>,
    pub(crate) stamp: u64,
}

impl Producer {
    pub(crate) fn start(path: &Path) -> Producer {
        let server = Server::bind(ServerConfig::new(path)).unwrap();
        for name in ["base", "extra"]
            .into_iter()
            .map(String::from)
            .chain((0..VICTIM_ENTRIES as u64).map(victim_entry))
        {
            let seed = entry_seed(&name);
            server
                .publish(
                    &name,
                    json!({ "len": LEN, "seed": seed }),
                    vec![memfd_with(&pattern(LEN, seed))],
                )
                .unwrap();
        }
        let mut slots = Vec::new();
        let mut slot_fds = Vec::new();
        for i in 0..RING_SLOTS {
            let fd = memfd_with(&[0u8; LEN]);
            slot_fds.push(fd.try_clone().unwrap());
            slots.push((json!({ "slot": i }), vec![fd]));
        }
        let ring = server.create_ring("ring", json!(null), slots).unwrap();
        Producer {
            server,
            ring,
            slot_fds,
            stamp: 0,
        }
    }

    /// Acquires a slot, writes a fresh stamp into it and publishes it.
    /// Returns the frame's sequence number.
    pub(crate) fn publish_frame(&mut self) -> u64 {
        let slot = self
            .ring
            .acquire(Some(ANSWER))
            .expect("a ring slot stayed in use");
        self.stamp += 1;
        rustix::io::pwrite(&self.slot_fds[slot as usize], &self.stamp.to_le_bytes(), 0).unwrap();
        self.ring
            .publish(slot, json!({ "stamp": self.stamp }))
            .unwrap()
    }

    /// Checks that every slot is free: acquires them all (in ring order),
    /// publishes the first and gives the others back. Returns the
    /// published frame's sequence number.
    pub(crate) fn check_ring(&mut self) -> u64 {
        let mut acquired = Vec::new();
        for _ in 0..RING_SLOTS {
            match self.ring.acquire(Some(NOTICE)) {
                Ok(slot) => acquired.push(slot),
                Err(e) => panic!("a ring slot is still held after the round ({acquired:?}): {e}"),
            }
        }
        let first = acquired.remove(0);
        for slot in acquired {
            self.ring.cancel(slot).unwrap();
        }
        self.stamp += 1;
        rustix::io::pwrite(&self.slot_fds[first as usize], &self.stamp.to_le_bytes(), 0).unwrap();
        self.ring
            .publish(first, json!({ "stamp": self.stamp }))
            .unwrap()
    }
}

/// Waits until `leases()` equals `expected`; panics after `within`.
pub(crate) fn leases_return_to(
    server: &Server,
    expected: &[LeaseInfo],
    within: Duration,
    what: &str,
) {
    let started = Instant::now();
    loop {
        let now = server.leases();
        if now == expected {
            return;
        }
        assert!(
            started.elapsed() < within,
            "{what}: the leases did not return to the survivors' within {within:?}: \
             expected {expected:?}, have {now:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

// ---------------------------------------------------------------------------
// Producers killed

/// How a client thread here ended, and when.
pub(crate) type Ended = (&'static str, Result<(), String>, Instant);

/// Runs `body` in a thread that reports how it ended on `tx`; `body`
/// sends on its `ready` once it is connected and attached.
pub(crate) fn watch(
    tx: &mpsc::Sender<Ended>,
    ready: &mpsc::Sender<()>,
    name: &'static str,
    body: impl FnOnce(mpsc::Sender<()>) -> Result<(), ChannelError> + Send + 'static,
) {
    let (tx, ready) = (tx.clone(), ready.clone());
    std::thread::spawn(move || {
        let r = body(ready);
        let at = Instant::now();
        let _ = tx.send((name, r.map_err(|e| format!("{e:?}")), at));
    });
}

/// Loops `step` until it fails, and returns that failure.
pub(crate) fn until_error(
    mut step: impl FnMut() -> Result<(), ChannelError>,
) -> Result<(), ChannelError> {
    let until = Instant::now() + CHILD_LIFETIME;
    while Instant::now() < until {
        step()?;
    }
    Ok(())
}
