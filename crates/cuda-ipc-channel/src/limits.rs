//! The limits both ends apply to what the protocol carries: names, metadata,
//! ring sizes. (Wire-level limits, [`MAX_PAYLOAD`](crate::wire::MAX_PAYLOAD)
//! and [`MAX_FDS`](crate::wire::MAX_FDS), are in [`wire`](crate::wire).)

use crate::ChannelError;

/// The largest `meta` or `notice` value, in bytes of JSON (256 KiB), so that
/// every message fits on the wire.
pub const MAX_META_BYTES: usize = 256 * 1024;

/// Entries whose names start with this are left out of listings
/// ([`Client::list`](crate::Client::list)): they are attached only by those
/// told the name (a writer's staging set, under an unguessable name).
pub const UNLISTED_ENTRY_PREFIX: &str = ".cuda-ipc/unlisted/";

/// The longest entry name, in bytes.
pub const MAX_ENTRY_NAME_LEN: usize = 256;

/// The most slots a ring may have.
pub const MAX_RING_SLOTS: usize = 1024;

/// Checks an entry or ring name: 1 to [`MAX_ENTRY_NAME_LEN`] bytes of UTF-8
/// without control characters.
pub fn validate_entry_name(name: &str) -> Result<(), ChannelError> {
    let invalid = |reason: String| ChannelError::InvalidName {
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("an entry name must not be empty".into()));
    }
    if name.len() > MAX_ENTRY_NAME_LEN {
        return Err(invalid(format!(
            "an entry name has at most {MAX_ENTRY_NAME_LEN} bytes, this one has {}",
            name.len()
        )));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(invalid(format!(
            "control character {c:?} is not allowed in an entry name"
        )));
    }
    Ok(())
}
