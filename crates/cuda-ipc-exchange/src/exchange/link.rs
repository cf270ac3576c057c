//! A subscriber's connection, which a reconnecting subscriber replaces
//! when its publisher's process ends and another serves the same socket.
//!
//! Every lease is taken on one connection, and is counted by its
//! **epoch**: 0 for the first connection, one more for each connection
//! made again. A lease of an older epoch ended with its connection (the
//! server that held it is gone), unless a reconnect took it back (see
//! `reconnect.rs`), which gives it an id of the new connection.
//!
//! Connecting again is bounded: tries spaced by a backoff (10 ms, doubling,
//! at most 500 ms between two) until the subscriber's timeout has passed,
//! then an error that names the socket and says no service answered. Each
//! connection made again first calls [`READY_METHOD`] and waits for any
//! answer: a publisher that answers calls only once it serves again what
//! it kept (the weight service, which takes back its sets before it
//! answers) is then ready for the leases to be taken back.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::channel::{ChannelError, Client, ClientConfig};

use super::lock;

/// Whether a [`Subscriber`](super::Subscriber) connects again when its
/// publisher's process is gone ([`SubscriberConfig::with_reconnect`](super::SubscriberConfig::with_reconnect)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reconnect {
    /// Only when the publisher said, as it welcomed the subscriber, that
    /// another process serves its socket after it (the weight service under
    /// its keeper: [`ServerConfig::restarts`](crate::channel::ServerConfig::restarts)).
    /// A plain publisher says no: its subscribers get
    /// [`ChannelError::PeerGone`] at once when it dies, as ever.
    #[default]
    IfPublisherRestarts,
    /// Always (a publisher that something else restarts on the same socket).
    Always,
    /// Never: the connection's end is [`ChannelError::PeerGone`] for good.
    Never,
}

/// The method a connection made again calls first, and waits for any
/// answer to: the weight service answers it once the sets it kept through
/// the restart are served again (a publisher without a call handler
/// answers at once, with an error that is taken as ready).
pub const READY_METHOD: &str = "ready";

/// The method a connection made again calls once it took back what it
/// could, with the body `{"pending": [SET, ...]}`: the sets it still maps
/// and could not take back yet (refused for now). The weight service then
/// stops counting this process as a reader of its process before that has
/// not connected again (but for those sets); a publisher without the
/// method answers with an error, which changes nothing.
pub const RECONNECTED_METHOD: &str = "reconnected";

/// The first pause between two tries to connect again.
const FIRST_PAUSE: Duration = Duration::from_millis(10);
/// The longest pause between two tries.
const LONGEST_PAUSE: Duration = Duration::from_millis(500);

/// A connection and its epoch.
#[derive(Clone, Debug)]
pub(super) struct Connection {
    pub(super) client: Arc<Client>,
    pub(super) epoch: u64,
}

/// The subscriber's connection now, and what it takes to make another.
pub(super) struct Link {
    path: PathBuf,
    config: ClientConfig,
    policy: Reconnect,
    /// Whether the first publisher said another process serves after it.
    restarts: bool,
    now: std::sync::Mutex<Connection>,
    /// The epoch of `now`, readable without the lock.
    epoch: AtomicU64,
    /// Held while a connection is made again and its leases taken back:
    /// one at a time.
    pub(super) reconnecting: std::sync::Mutex<()>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("path", &self.path)
            .field("policy", &self.policy)
            .field("epoch", &self.epoch())
            .finish_non_exhaustive()
    }
}

impl Link {
    /// Connects to `path` (epoch 0). Where the policy may reconnect, a
    /// connection that ends before the publisher welcomed it (the process
    /// that accepted it ended: a service being restarted or upgraded under
    /// its keeper, which keeps the socket) is tried again, as a reconnect
    /// is, within the timeout; any other failure is final, as ever.
    pub(super) fn connect(
        path: PathBuf,
        config: ClientConfig,
        policy: Reconnect,
    ) -> Result<Link, ChannelError> {
        let client = match Client::connect(&path, config.clone()) {
            Err(ChannelError::PeerGone) if policy != Reconnect::Never => {
                let deadline = crate::channel::deadline_in(config.timeout);
                retry(deadline, Instant::now, std::thread::sleep, |left| {
                    match Client::connect_within(&path, config.clone(), left) {
                        Ok(c) => Try::Done(c),
                        Err(ChannelError::PeerGone) => Try::Again(ChannelError::PeerGone),
                        Err(e) => Try::Fatal(e),
                    }
                })
                .map_err(|last| last.unwrap_or(ChannelError::PeerGone))?
            }
            r => r?,
        };
        Ok(Link::over(path, config, policy, Arc::new(client)))
    }

    /// A link whose first connection is `client`.
    pub(super) fn over(
        path: PathBuf,
        config: ClientConfig,
        policy: Reconnect,
        client: Arc<Client>,
    ) -> Link {
        Link {
            restarts: client.server_restarts(),
            path,
            config,
            policy,
            now: std::sync::Mutex::new(Connection { client, epoch: 0 }),
            epoch: AtomicU64::new(0),
            reconnecting: std::sync::Mutex::new(()),
        }
    }

    /// The socket path.
    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// The connection now.
    pub(super) fn now(&self) -> Connection {
        lock(&self.now).clone()
    }

    /// The client of the connection now.
    pub(super) fn client(&self) -> Arc<Client> {
        Arc::clone(&lock(&self.now).client)
    }

    /// The epoch of the connection now.
    pub(super) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Whether this subscriber connects again when the connection ends.
    pub(super) fn reconnects(&self) -> bool {
        match self.policy {
            Reconnect::Always => true,
            Reconnect::IfPublisherRestarts => self.restarts,
            Reconnect::Never => false,
        }
    }

    /// Whether the connection now is up (without waiting).
    pub(super) fn is_alive(&self) -> bool {
        self.client().is_alive()
    }

    /// Connects again, within `timeout` (see the module docs), and makes
    /// the new connection the one now; returns it. The caller holds
    /// [`Link::reconnecting`].
    pub(super) fn connect_again(&self, timeout: Duration) -> Result<Connection, ChannelError> {
        let started = Instant::now();
        let deadline = crate::channel::deadline_in(timeout);
        let client = retry(deadline, Instant::now, std::thread::sleep, |left| {
            self.dial(left)
        })
        .map_err(|last| ChannelError::Timeout {
            what: format!(
                "a service to answer at {} again after its process ended: no service \
                 answered (last try: {}); start the service (under its keeper, `cuda-ipc \
                 serve --service`, it comes back by itself), or check the socket path",
                self.path.display(),
                last.map_or_else(|| "none".to_owned(), |e| e.to_string())
            ),
            after: started.elapsed(),
        })?;
        let mut now = lock(&self.now);
        let epoch = now.epoch + 1;
        *now = Connection {
            client: Arc::new(client),
            epoch,
        };
        self.epoch.store(epoch, Ordering::Release);
        Ok(now.clone())
    }

    /// One try: connect, then wait for the ready call's answer.
    fn dial(&self, left: Duration) -> Try<Client> {
        // Within the time left; the requests' timeout stays the configured one.
        let client = match Client::connect_within(&self.path, self.config.clone(), left) {
            Ok(c) => c,
            // A server that refuses us, or speaks another protocol, will
            // not change its mind.
            Err(e @ (ChannelError::Refused { .. } | ChannelError::Protocol { .. })) => {
                return Try::Fatal(e);
            }
            Err(e) => return Try::Again(e),
        };
        match client.call_within(READY_METHOD, &json!({}), left) {
            Ok(_) | Err(ChannelError::Remote { .. }) => Try::Done(client),
            Err(e) => Try::Again(e),
        }
    }
}

/// What one try to connect gave.
#[derive(Debug)]
pub(super) enum Try<T> {
    /// Connected.
    Done(T),
    /// Not now: try again after a pause, while time is left.
    Again(ChannelError),
    /// Never: stop.
    Fatal(ChannelError),
}

/// Tries `attempt` (given the time left) until it is done or fatal, or
/// `deadline` has passed, with pauses between tries from [`pauses`];
/// `now` and `sleep` are the clock's. `Err` carries the last error (`None`
/// when no try was made).
pub(super) fn retry<T>(
    deadline: Instant,
    now: impl Fn() -> Instant,
    mut sleep: impl FnMut(Duration),
    mut attempt: impl FnMut(Duration) -> Try<T>,
) -> Result<T, Option<ChannelError>> {
    let mut pauses = pauses();
    let mut last = None;
    loop {
        let left = deadline.saturating_duration_since(now());
        if left.is_zero() {
            return Err(last);
        }
        match attempt(left) {
            Try::Done(t) => return Ok(t),
            Try::Fatal(e) => return Err(Some(e)),
            Try::Again(e) => last = Some(e),
        }
        let left = deadline.saturating_duration_since(now());
        if left.is_zero() {
            return Err(last);
        }
        // `pauses` never ends.
        sleep(pauses.next().unwrap_or(LONGEST_PAUSE).min(left));
    }
}

/// The pauses between tries: 10 ms, doubling, at most 500 ms.
fn pauses() -> impl Iterator<Item = Duration> {
    std::iter::successors(Some(FIRST_PAUSE), |p| Some((*p * 2).min(LONGEST_PAUSE)))
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};

    use super::*;

    /// A clock that only moves when slept on.
    struct Clock {
        start: Instant,
        at: Cell<Duration>,
        slept: RefCell<Vec<Duration>>,
    }

    impl Clock {
        fn new() -> Clock {
            Clock {
                start: Instant::now(),
                at: Cell::new(Duration::ZERO),
                slept: RefCell::new(Vec::new()),
            }
        }
        fn now(&self) -> Instant {
            self.start + self.at.get()
        }
        fn sleep(&self, d: Duration) {
            self.at.set(self.at.get() + d);
            self.slept.borrow_mut().push(d);
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_pauses_double_up_to_half_a_second() {
        let p: Vec<u64> = pauses().take(9).map(|d| d.as_millis() as u64).collect();
        assert_eq!(p, [10, 20, 40, 80, 160, 320, 500, 500, 500]);
    }

    #[test]
    fn tries_until_the_deadline_then_gives_the_last_error() {
        let clock = Clock::new();
        let deadline = clock.now() + ms(1000);
        let tries = Cell::new(0);
        let got: Result<(), _> = retry(
            deadline,
            || clock.now(),
            |d| clock.sleep(d),
            |left| {
                tries.set(tries.get() + 1);
                assert!(left > Duration::ZERO && left <= ms(1000));
                Try::Again(ChannelError::PeerGone)
            },
        );
        assert!(matches!(got, Err(Some(ChannelError::PeerGone))), "{got:?}");
        // 10+20+40+80+160+320 = 630 ms, then 370 ms (cut at the deadline).
        assert_eq!(
            *clock.slept.borrow(),
            [ms(10), ms(20), ms(40), ms(80), ms(160), ms(320), ms(370)]
        );
        assert_eq!(tries.get(), 7, "no try after the deadline");
        assert_eq!(clock.at.get(), ms(1000), "never past the deadline");
    }

    #[test]
    fn stops_at_the_first_success_or_fatal_error() {
        let clock = Clock::new();
        let deadline = clock.now() + ms(5000);
        let tries = Cell::new(0);
        let got = retry(
            deadline,
            || clock.now(),
            |d| clock.sleep(d),
            |_| {
                tries.set(tries.get() + 1);
                if tries.get() < 3 {
                    Try::Again(ChannelError::PeerGone)
                } else {
                    Try::Done(tries.get())
                }
            },
        );
        assert_eq!(got.unwrap(), 3);
        assert_eq!(*clock.slept.borrow(), [ms(10), ms(20)]);

        let tries = Cell::new(0);
        let got: Result<(), _> = retry(
            deadline,
            || clock.now(),
            |d| clock.sleep(d),
            |_| {
                tries.set(tries.get() + 1);
                Try::Fatal(ChannelError::Protocol {
                    reason: "no".into(),
                })
            },
        );
        assert!(matches!(got, Err(Some(ChannelError::Protocol { .. }))));
        assert_eq!(tries.get(), 1, "a fatal error is not tried again");
    }

    #[test]
    fn a_deadline_already_passed_tries_nothing() {
        let clock = Clock::new();
        let got: Result<(), _> = retry(
            clock.now(),
            || clock.now(),
            |d| clock.sleep(d),
            |_| unreachable!("no time left"),
        );
        assert!(matches!(got, Err(None)));
    }

    #[test]
    fn the_policy_follows_what_the_server_said() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        for restarts in [false, true] {
            let server = crate::channel::Server::bind(
                crate::channel::ServerConfig::new(&path).with_restarts(restarts),
            )
            .unwrap();
            for (policy, want) in [
                (Reconnect::IfPublisherRestarts, restarts),
                (Reconnect::Always, true),
                (Reconnect::Never, false),
            ] {
                let link = Link::connect(path.clone(), ClientConfig::default(), policy).unwrap();
                assert_eq!(link.reconnects(), want, "{policy:?}, restarts {restarts}");
                assert_eq!(link.epoch(), 0);
            }
            drop(server);
        }
    }

    #[test]
    fn connecting_again_gives_a_new_epoch_and_gives_up_naming_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let server =
            crate::channel::Server::bind(crate::channel::ServerConfig::new(&path)).unwrap();
        let link = Link::connect(path.clone(), ClientConfig::default(), Reconnect::Always).unwrap();
        let first = link.client();
        drop(server);
        let deadline = Instant::now() + Duration::from_secs(5);
        while first.is_alive() && Instant::now() < deadline {
            std::thread::sleep(ms(2));
        }
        assert!(!link.is_alive());
        // Nobody serves: bounded, and the error says where and what.
        let t = Instant::now();
        let e = link.connect_again(ms(300)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let text = e.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("no service answered"), "{text}");
        assert_eq!(link.epoch(), 0);
        // Someone serves again (a plain server answers the ready call with
        // `no_handler`: ready).
        let _server =
            crate::channel::Server::bind(crate::channel::ServerConfig::new(&path)).unwrap();
        let c = link.connect_again(Duration::from_secs(5)).unwrap();
        assert_eq!((c.epoch, link.epoch()), (1, 1));
        let timeout = format!("timeout: {:?}", ClientConfig::default().timeout);
        assert!(
            format!("{:?}", c.client).contains(&timeout),
            "the requests' timeout is the configured one, not what was left: {:?}",
            c.client
        );
        assert!(link.is_alive());
        assert!(!Arc::ptr_eq(&c.client, &first));
    }
}
