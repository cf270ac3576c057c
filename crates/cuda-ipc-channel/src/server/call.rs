//! Calls: a client's [`Message::Call`] answered by the server's
//! [`CallHandler`] with a [`Message::Reply`] or an error.
//!
//! The channel knows nothing of the methods: the handler (a service built on
//! the server, such as `cuda-ipc serve --service`) names them and reads
//! their bodies. A call runs on its connection's reader thread, so a slow
//! method (a checkpoint load) holds up that connection's next requests and
//! nothing else. A handler that panics answers `internal`; the connection
//! and the server go on.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use serde_json::Value;

use crate::socket::Ucred;
use crate::wire::{MAX_PAYLOAD, Message};
use crate::{ChannelError, lock};

use super::conn::Conn;
use super::state::{LeaseEvent, LeaseFn};
use super::{Server, Shared};

/// The longest method name, in bytes.
pub const MAX_METHOD_LEN: usize = 64;

/// Checks a method name: 1 to [`MAX_METHOD_LEN`] bytes of `a-z`, `0-9`,
/// `_` and `.`.
///
/// # Errors
/// [`ChannelError::InvalidArgument`] naming the method and what is wrong.
pub fn validate_method(method: &str) -> Result<(), ChannelError> {
    let reason = if method.is_empty() {
        "it is empty".to_owned()
    } else if method.len() > MAX_METHOD_LEN {
        format!(
            "it is {} bytes long, more than {MAX_METHOD_LEN}",
            method.len()
        )
    } else if let Some(c) = method
        .chars()
        .find(|c| !matches!(c, 'a'..='z' | '0'..='9' | '_' | '.'))
    {
        format!("it holds {c:?}; a method is made of a-z, 0-9, '_' and '.'")
    } else {
        return Ok(());
    };
    Err(ChannelError::arg(
        "method",
        format!("{}: {reason}", super::session::shown(method)),
    ))
}

/// Who is calling, as the handler sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallContext {
    /// The caller's credentials (`SO_PEERCRED`): trust `uid`, not what the
    /// body says.
    pub peer: Ucred,
    /// The caller's connection, unique for the server's life.
    pub connection: u64,
}

/// A handler's refusal: sent to the caller as an
/// [`Error`](Message::Error) answering its call.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct CallError {
    /// A machine-readable code, for example `"quota"`.
    pub code: String,
    /// A sentence for people: what happened and what to do.
    pub message: String,
    /// Structured details, or `null`.
    pub details: Value,
}

impl CallError {
    /// An error with `code` and `message` and no details.
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> CallError {
        CallError {
            code: code.into(),
            message: message.into(),
            details: Value::Null,
        }
    }

    /// The same error with structured details.
    #[must_use]
    pub fn with_details(mut self, details: Value) -> CallError {
        self.details = details;
        self
    }
}

/// What a handler function looks like: the caller, the method (already
/// checked by [`validate_method`]) and the body; the answer's body or an
/// error.
pub type CallFn = dyn Fn(&CallContext, &str, &Value) -> Result<Value, CallError> + Send + Sync;

/// What a handler runs when a connection closes: its
/// [`CallContext::connection`].
pub type ClosedFn = dyn Fn(u64) + Send + Sync;

/// The server's answerer of [`Message::Call`]s (see the module docs). A
/// server without one answers every call with the error `no_handler`.
#[derive(Clone)]
pub struct CallHandler(Arc<CallFn>, Option<Arc<ClosedFn>>, Option<Arc<LeaseFn>>);

impl CallHandler {
    /// A handler that runs `f` for every call.
    pub fn new(
        f: impl Fn(&CallContext, &str, &Value) -> Result<Value, CallError> + Send + Sync + 'static,
    ) -> CallHandler {
        CallHandler(Arc::new(f), None, None)
    }

    /// The same handler, also running `closed` with a connection's id once
    /// the connection has ended (the client closed it, exited or was
    /// killed, or the server closed it) and its leases with it: what a
    /// call made a connection hold (a lock) can be let go there. It runs
    /// for every connection, called or not, on the thread that ended it,
    /// and must not block.
    #[must_use]
    pub fn on_close(mut self, closed: impl Fn(u64) + Send + Sync + 'static) -> CallHandler {
        self.1 = Some(Arc::new(closed));
        self
    }
}

impl CallHandler {
    /// The same handler, also running `lease` each time a lease is granted
    /// (before the client hears of it) or ends. It runs under the server's
    /// state lock, on the thread that granted or ended the lease, so it
    /// must be quick and must not block or call the server: what it
    /// records is in place before the holder can use what it leased.
    #[must_use]
    pub fn on_lease(
        mut self,
        lease: impl for<'a> Fn(&LeaseEvent<'a>) + Send + Sync + 'static,
    ) -> CallHandler {
        self.2 = Some(Arc::new(lease));
        self
    }

    pub(super) fn lease_watch(&self) -> Option<Arc<LeaseFn>> {
        self.2.clone()
    }
}

impl std::fmt::Debug for CallHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallHandler(..)")
    }
}

impl Server {
    /// Sets (or, with `None`, removes) the handler that answers calls,
    /// replacing the one of [`ServerConfig::call_handler`](super::ServerConfig::call_handler).
    /// Calls already running finish with the handler they started with.
    /// A handler that holds the server (or what holds it) makes a cycle:
    /// hold a `Weak` in it instead.
    pub fn set_call_handler(&self, handler: Option<CallHandler>) {
        let watch = handler.as_ref().and_then(CallHandler::lease_watch);
        *lock(&self.shared.call_handler) = handler;
        lock(&self.shared.state).lease_watch = watch;
    }
}

impl Shared {
    /// Tells the call handler that connection `conn` ended.
    pub(super) fn connection_closed(&self, conn: u64) {
        let closed = lock(&self.call_handler).as_ref().and_then(|h| h.1.clone());
        if let Some(closed) = closed
            && catch_unwind(AssertUnwindSafe(|| closed(conn))).is_err()
        {
            tracing::error!(conn, "a call handler's close hook panicked");
        }
    }

    /// Answers one call.
    pub(super) fn call(&self, conn: &Conn, id: u64, method: &str, body: &Value) {
        let answer = self.answer(conn, id, method, body);
        // An answer too long for the wire would end the connection with an
        // error that answers nothing: answer this call with the error.
        let answer = match &answer {
            Message::Reply { .. } if answer.encode().len() > MAX_PAYLOAD as usize => error(
                id,
                CallError::new(
                    "reply_too_large",
                    format!(
                        "the answer to {method:?} is longer than the {MAX_PAYLOAD} bytes a \
                         message carries"
                    ),
                ),
            ),
            _ => answer,
        };
        conn.push(answer, Vec::new(), self.max_queued);
    }

    fn answer(&self, conn: &Conn, id: u64, method: &str, body: &Value) -> Message {
        if let Err(e) = validate_method(method) {
            return error(id, CallError::new("invalid_method", e.to_string()));
        }
        let Some(handler) = lock(&self.call_handler).clone() else {
            return error(
                id,
                CallError::new(
                    "no_handler",
                    format!(
                        "this server answers no calls (it has no call handler), so not \
                         {method:?}; is it a plain publisher? Calls are for a service \
                         (`cuda-ipc serve --service`)"
                    ),
                ),
            );
        };
        let ctx = CallContext {
            peer: conn.cred,
            connection: conn.id,
        };
        match catch_unwind(AssertUnwindSafe(|| (handler.0)(&ctx, method, body))) {
            Ok(Ok(body)) => Message::Reply { id, body },
            Ok(Err(e)) => error(id, e),
            Err(_) => {
                tracing::error!(method, "a call handler panicked");
                error(
                    id,
                    CallError::new(
                        "internal",
                        format!("the server failed while answering {method:?}; see its log"),
                    ),
                )
            }
        }
    }
}

fn error(id: u64, e: CallError) -> Message {
    Message::Error {
        id: Some(id),
        code: e.code,
        message: e.message,
        details: e.details,
    }
}

#[cfg(test)]
#[path = "call_tests.rs"]
mod tests;
