//! The exchange channel: framed, versioned messages over a Unix socket, with
//! file descriptors (SCM_RIGHTS), peer credentials, names, leases, updates
//! and rings. Independent of CUDA, so it is fully testable without a GPU.

use crate::error::ErrorKind;

/// Errors of the exchange channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelError {
    /// The peer closed the connection or died.
    #[error("the peer closed the connection (it exited or was killed)")]
    PeerGone,
}

impl ChannelError {
    /// The class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ChannelError::PeerGone => ErrorKind::Peer,
        }
    }
}
