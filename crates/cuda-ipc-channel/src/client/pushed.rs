//! A pushed entry as the client reads it ([`Server::push`](crate::Server::push)).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ChannelError;
use crate::wire::PUSHED_KEY;

use super::Attachment;

/// An entry pushed to this client: the lease it holds on it (released as
/// any other), its name and its metadata, as a pushed notice carries them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct PushedEntry {
    /// The lease granted.
    pub lease: u64,
    /// The entry's name.
    pub name: String,
    /// Its metadata.
    pub meta: Value,
}

impl PushedEntry {
    /// The pushed entry as an attachment of it: the lease, the name, the
    /// metadata, and no descriptors (a push carries none).
    pub fn into_attachment(self) -> Attachment {
        Attachment {
            lease: self.lease,
            name: self.name,
            meta: self.meta,
            fds: Vec::new(),
        }
    }

    /// The pushed entry an update's notice carries, if it carries one.
    ///
    /// # Errors
    /// [`ChannelError::Protocol`] for a pushed notice that does not decode.
    pub fn from_notice(notice: &Value) -> Option<Result<PushedEntry, ChannelError>> {
        let pushed = notice.as_object()?.get(PUSHED_KEY)?;
        Some(
            PushedEntry::deserialize(pushed).map_err(|e| ChannelError::Protocol {
                reason: format!("a pushed entry's notice: {e}"),
            }),
        )
    }
}
