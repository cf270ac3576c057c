//! How a [`Publisher`](super::Publisher) serves: [`PublisherConfig`].

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::error::{Error, Result};

use super::sharing::Sharing;

/// How a [`Publisher`](super::Publisher) serves: `PublisherConfig::default()`, adjusted with
/// the `with_` methods.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
#[allow(clippy::struct_excessive_bools)] // independent switches, each with its `with_` method
pub struct PublisherConfig {
    /// User ids allowed to connect besides our own (peer credentials are
    /// checked on every connection).
    pub allow_uids: Vec<u32>,
    /// Publish without GPU-side fences (events only): subscribers that
    /// cannot open events (their own `/dev/shm`) then cannot attach.
    pub no_fences: bool,
    /// How buffers are shared: from an arena (the default, `auto`) or
    /// each exported on its own ([`Sharing::Isolated`]).
    pub sharing: Sharing,
    /// Readers map every set and arena buffer read-only
    /// ([`Access::ReadOnly`](cuda_ipc_core::Access::ReadOnly)): the set record says
    /// so, and a subscriber maps it so whatever it asked for (off by
    /// default; see [`PublisherConfig::with_read_only_readers`]).
    pub read_only_readers: bool,
    /// The longest request a client may send, in bytes (`None`: the
    /// channel's default, 4 KiB; a service that takes layouts in calls
    /// needs more).
    pub max_request_bytes: Option<u32>,
    /// How long a serving thread polls its connection before it sleeps
    /// (`None`: the channel's default,
    /// [`DEFAULT_SERVER_SPIN`](crate::channel::DEFAULT_SERVER_SPIN), 50 µs;
    /// `Duration::ZERO` sleeps at once, which saves a core's worth of
    /// polling on a busy machine and costs a wake-up per request).
    pub spin: Option<std::time::Duration>,
    /// A listening socket kept from a process before, to serve on instead
    /// of binding a new one (see [`PublisherConfig::with_listener`]).
    pub listener: Option<Arc<OwnedFd>>,
    /// What answers calls from the first connection on (see
    /// [`PublisherConfig::with_call_handler`]).
    pub call_handler: Option<crate::channel::CallHandler>,
    /// Tells subscribers that another process serves this socket after
    /// this one ends, with what it published (see
    /// [`PublisherConfig::with_restarts`]).
    pub restarts: bool,
    /// Accepts no subscriber until
    /// [`Server::start_accepting`](crate::channel::Server::start_accepting)
    /// (see [`PublisherConfig::with_accept_held`]).
    pub accept_held: bool,
}

impl PublisherConfig {
    /// Accepts no subscriber until `publisher.server().start_accepting()`:
    /// those that connect meanwhile wait (up to their timeout), for a
    /// publisher that publishes what it serves first
    /// ([`ServerConfig::accept_held`](crate::channel::ServerConfig::accept_held)).
    #[must_use]
    pub fn with_accept_held(mut self, on: bool) -> Self {
        self.accept_held = on;
        self
    }

    /// Tells subscribers that another process serves this socket after
    /// this one ends, from the same memory (a keeper holds the listening
    /// socket and the arena's chunks: the weight service under its keeper);
    /// their default [`Reconnect`](super::Reconnect) then connects again
    /// and takes their leases back
    /// ([`ServerConfig::restarts`](crate::channel::ServerConfig::restarts)).
    #[must_use]
    pub fn with_restarts(mut self, on: bool) -> Self {
        self.restarts = on;
        self
    }

    /// Polls this long before sleeping (see [`PublisherConfig::spin`]).
    #[must_use]
    pub fn with_spin(mut self, spin: std::time::Duration) -> Self {
        self.spin = Some(spin);
        self
    }

    /// Accepts requests (calls' bodies) of up to `bytes` bytes (at most the
    /// channel's message limit, 1 MiB).
    #[must_use]
    pub fn with_max_request_bytes(mut self, bytes: u32) -> Self {
        self.max_request_bytes = Some(bytes);
        self
    }

    /// Lets processes of these user ids connect too, besides our own.
    #[must_use]
    pub fn with_allow_uids(mut self, uids: impl IntoIterator<Item = u32>) -> Self {
        self.allow_uids.extend(uids);
        self
    }

    /// Answers calls with `handler` from the first connection on (a
    /// handler set later with
    /// [`Server::set_call_handler`](crate::channel::Server::set_call_handler)
    /// leaves a moment in which calls are refused `no_handler`).
    #[must_use]
    pub fn with_call_handler(mut self, handler: crate::channel::CallHandler) -> Self {
        self.call_handler = Some(handler);
        self
    }

    /// Serves on `listener`, the listening socket of a publisher before it
    /// at the same path ([`Server::listener`](crate::channel::Server::listener),
    /// kept by a keeper or systemd), instead of binding a new one: clients
    /// that connect while no process serves wait instead of being refused
    /// ([`ServerConfig::with_listener`](crate::channel::ServerConfig::with_listener)).
    #[must_use]
    pub fn with_listener(mut self, listener: OwnedFd) -> Self {
        self.listener = Some(Arc::new(listener));
        self
    }

    /// Whether every publish, update and ring frame also signals a fence
    /// (on by default; see [`SyncMode`](super::SyncMode)).
    #[must_use]
    pub fn with_fences(mut self, on: bool) -> Self {
        self.no_fences = !on;
        self
    }

    /// Shares through an arena (the default) or each buffer on its own.
    #[must_use]
    pub fn with_sharing(mut self, sharing: Sharing) -> Self {
        self.sharing = sharing;
        self
    }

    /// Makes readers map what this publisher publishes read-only (`true`)
    /// or as they ask (`false`, the default). Read-only readers are a
    /// policy of sets and arena buffers, whose record carries it, from an
    /// arena of vmm chunks (an `auto` arena then uses vmm): a reader's
    /// kernel or copy that writes through its mapping fails, and the
    /// publisher's bytes do not change. Not for [`Publisher::publish`](super::Publisher::publish) or
    /// [`Publisher::ring`](super::Publisher::ring), which refuse while it is on. A guard against
    /// mistakes, not malice: a reader holds the chunks' file descriptors and
    /// could import them again read-write.
    #[must_use]
    pub fn with_read_only_readers(mut self, on: bool) -> Self {
        self.read_only_readers = on;
        self
    }

    /// Checks that the options go together (no driver needed; [`Publisher::bind`](super::Publisher::bind)
    /// calls it first).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for read-only readers with
    /// [`Sharing::Isolated`] (no set record to carry the policy) or with
    /// an arena of legacy or pool chunks, which cannot be mapped read-only
    /// (see [`Mechanism::check_access`](crate::descriptor::Mechanism::check_access)).
    pub fn validate(&self) -> Result<()> {
        if !self.read_only_readers {
            return Ok(());
        }
        match &self.sharing {
            Sharing::Isolated => Err(Error::arg(
                "read-only readers",
                "they are a policy of sets, which come from the publisher's arena, but this \
                 publisher is configured isolated (no arena); configure Sharing::Arena with the \
                 vmm mechanism, or leave read_only_readers off",
            )),
            Sharing::Arena {
                mechanism: Some(m), ..
            } => match m.why_not_read_only() {
                None => Ok(()),
                Some(why) => Err(Error::arg(
                    "read-only readers",
                    format!(
                        "an arena of {m} chunks cannot be mapped read-only: {why}; use an arena \
                         of vmm chunks (Sharing::arena(Mechanism::Vmm) or auto; `--mechanism \
                         vmm` or auto)"
                    ),
                )),
            },
            Sharing::Arena {
                mechanism: None, ..
            } => Ok(()),
        }
    }
}
