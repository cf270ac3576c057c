//! [`Client::call`]: a method of the server's call handler (see
//! `server::CallHandler`).

use std::time::Duration;

use serde_json::Value;

use super::{Client, unexpected};
use crate::ChannelError;
use crate::server::validate_method;
use crate::wire::Message;

impl Client {
    /// Calls `method` of the server's call handler with `body` and returns
    /// the answer's body, waiting up to the client's request timeout
    /// ([`ClientConfig::timeout`](super::ClientConfig::timeout)).
    ///
    /// # Errors
    /// [`ChannelError::InvalidArgument`] for a method name that
    /// [`validate_method`] refuses (nothing is sent);
    /// [`ChannelError::Remote`] with the handler's code and message (or
    /// `no_handler` from a server without one, `not_found` included);
    /// [`ChannelError::Timeout`]; the connection's errors.
    pub fn call(&self, method: &str, body: &Value) -> Result<Value, ChannelError> {
        self.call_within(method, body, self.timeout)
    }

    /// [`call`](Self::call), waiting up to `timeout` for the answer (for a
    /// method that takes long, such as a service's checkpoint load).
    ///
    /// # Errors
    /// As [`call`](Self::call).
    pub fn call_within(
        &self,
        method: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<Value, ChannelError> {
        validate_method(method)?;
        let mut p = self.request(
            |id| Message::Call {
                id,
                method: method.to_owned(),
                body: body.clone(),
            },
            None,
        )?;
        p.deadline = crate::deadline_in(timeout);
        let what = format!("the answer to {method:?}");
        match self.response(&p, &what)? {
            (Message::Reply { body, .. }, _) => Ok(body),
            (Message::Error { code, message, .. }, _) => {
                Err(ChannelError::Remote { code, message })
            }
            (other, _) => Err(unexpected(other, "reply", "")),
        }
    }
}
