//! What a subscriber's sleep or wake did.

/// What a sleep or a wake did: how many mappings, of how many bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slept {
    /// Mappings unmapped (sleep) or mapped again (wake).
    pub mappings: usize,
    /// Their bytes.
    pub bytes: u64,
}
