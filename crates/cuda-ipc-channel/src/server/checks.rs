//! Checks of what a producer gives the server: its configuration, values,
//! descriptor counts, and the socket file it bound.

use std::path::Path;

use rustix::fs::FileType;
use serde_json::Value;

use crate::limits::MAX_META_BYTES;
use crate::wire::{MAX_FDS, Meta};
use crate::{ChannelError, own_uid};

use super::ServerConfig;

/// Checks the limits of a configuration, and that this process's
/// open-file limit carries them (see [`ensure_fd_limit`]).
pub(super) fn check_config(config: &ServerConfig) -> Result<(), ChannelError> {
    if config.allowed_uids.is_empty() {
        return Err(ChannelError::arg(
            "allowed_uids",
            "the list is empty, so no client could connect; list at least one user id",
        ));
    }
    if config.max_connections == 0 || config.max_queued_frames == 0 {
        return Err(ChannelError::arg(
            "server limits",
            "max_connections and max_queued_frames must be at least 1",
        ));
    }
    if config.reserved_connections >= config.max_connections {
        return Err(ChannelError::arg(
            "server limits",
            format!(
                "reserved_connections ({}) must be below max_connections ({}), or no other \
                 user could connect",
                config.reserved_connections, config.max_connections
            ),
        ));
    }
    ensure_fd_limit(config)
}

/// The size of a value's JSON, refused above [`MAX_META_BYTES`].
pub(super) fn json_size(value: &Value, what: &'static str) -> Result<usize, ChannelError> {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a `Value` into a counter cannot fail.
    let _ = serde_json::to_writer(&mut count, value);
    check_json_len(count.0, what)
}

/// An entry's metadata with its JSON text made (what every answer about
/// the entry sends), and the text's length, refused above
/// [`MAX_META_BYTES`].
pub(super) fn encoded_meta(meta: Meta) -> Result<(Meta, usize), ChannelError> {
    // Encoded here unless the producer encoded it already.
    let len = check_json_len(meta.text_len(), "meta")?;
    Ok((meta, len))
}

/// `len` (the bytes of `what`'s JSON) if it is within [`MAX_META_BYTES`].
fn check_json_len(len: usize, what: &'static str) -> Result<usize, ChannelError> {
    if len > MAX_META_BYTES {
        return Err(ChannelError::arg(
            what,
            format!(
                "its JSON is {len} bytes, more than the limit of {MAX_META_BYTES}; put large data \
                 in shared memory and describe it here"
            ),
        ));
    }
    Ok(len)
}

pub(super) fn check_fds(count: usize) -> Result<(), ChannelError> {
    if count > MAX_FDS {
        return Err(ChannelError::arg(
            "file descriptors",
            format!("an entry or slot carries at most {MAX_FDS} file descriptors, not {count}"),
        ));
    }
    Ok(())
}

/// Descriptors and in-flight room this process needs besides what the
/// clients may pin: its own sockets, entries and duplicates, and other
/// processes of the same user that pass descriptors.
const FD_HEADROOM: u64 = 1024;

/// Makes sure the kernel's per-user limit on descriptors in flight (the
/// soft `RLIMIT_NOFILE` of the sending process) carries what `config` lets
/// clients leave unread: raises the soft limit if needed and the hard limit
/// allows, else refuses the configuration, saying what to change.
pub(super) fn ensure_fd_limit(config: &ServerConfig) -> Result<(), ChannelError> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let per_conn = config.max_unread_fds.max(MAX_FDS) as u64;
    let in_flight = per_conn.saturating_mul(config.max_connections as u64);
    // Each connection's socket, and with shared-memory notices our end of
    // its wake-up pair (the memfd and the client's end are closed once
    // sent: the mapping keeps the memfd).
    let own = if config.notices == crate::NoticePath::Shm {
        2
    } else {
        1
    };
    let need = in_flight
        .saturating_add(own * config.max_connections as u64)
        .saturating_add(FD_HEADROOM);
    let limit = getrlimit(Resource::Nofile);
    // `None` is unlimited.
    let soft = limit.current.unwrap_or(u64::MAX);
    if soft >= need {
        return Ok(());
    }
    let hard = limit.maximum.unwrap_or(u64::MAX);
    if hard < need {
        return Err(ChannelError::arg(
            "server limits",
            format!(
                "max_connections ({}) x max_unread_fds ({per_conn}) lets clients leave \
                 {in_flight} descriptors unread, which the kernel charges to this user's \
                 open-file limit; with this server's own descriptors that needs RLIMIT_NOFILE \
                 of {need}, but the hard limit is {hard}: lower max_connections or \
                 max_unread_fds, or raise the hard limit (ulimit -Hn, systemd LimitNOFILE=)",
                config.max_connections
            ),
        ));
    }
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(need),
            maximum: limit.maximum,
        },
    )
    .map_err(|e| {
        ChannelError::io(
            format!(
                "cannot raise the soft open-file limit from {soft} to the {need} that \
                 max_connections x max_unread_fds needs"
            ),
            e,
        )
    })?;
    tracing::info!(
        from = soft,
        to = need,
        "raised the soft open-file limit (RLIMIT_NOFILE) to carry the descriptors clients may \
         leave unread"
    );
    Ok(())
}

/// What is at `path` right after bind, without following links: it must
/// be a socket of ours that only we may use.
pub(super) fn bound_socket(path: &Path) -> Result<rustix::fs::Stat, ChannelError> {
    let st = rustix::fs::lstat(path)
        .map_err(|e| ChannelError::io(format!("cannot inspect {}", path.display()), e))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::Socket
        || st.st_uid != own_uid()
        || st.st_mode & 0o077 != 0
    {
        return Err(ChannelError::arg(
            "socket path",
            format!(
                "{} is not the private socket just bound there (mode {:o}, owner {}): \
                 something replaced it; use a private directory (default_socket_dir)",
                path.display(),
                st.st_mode & 0o7777,
                st.st_uid
            ),
        ));
    }
    Ok(st)
}
