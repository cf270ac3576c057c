//! The wire form: the block record sent once, and the reference to a word
//! and sequence number sent with each publish.

use serde::{Deserialize, Serialize};

use super::{MAX_WORDS, WORD, check_seq, check_word};
use crate::descriptor::{Descriptor, Dtype};
use crate::error::{Error, Result};

// ---------------------------------------------------------------------------
// Wire form

/// A fence block as it travels once from producer to consumer: where its
/// words are and how many. Serialises as `{"descriptor": {...}, "words":
/// N}` for device words and `{"host": {"fd": F, "pid": P, "id": I},
/// "words": N}` for host words (a memfd, whose descriptor travels beside
/// the record, or is fetched from process `pid` as descriptor `fd`).
/// Decoding refuses unknown fields, both or neither placement, and a
/// descriptor that is not a valid export of exactly `words` 8-byte words
/// with a generation (the block's identity).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawFenceBlock", into = "RawFenceBlock")]
pub struct FenceBlock {
    pub(super) placement: Placement,
    pub(super) words: u32,
}

/// Where a block's words are, on the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Placement {
    Device(Box<Descriptor>),
    Host { fd: i32, pid: u32, id: u64 },
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFenceBlock {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    descriptor: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    host: Option<RawHost>,
    words: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHost {
    fd: i32,
    pid: u32,
    id: u64,
}

impl TryFrom<RawFenceBlock> for FenceBlock {
    type Error = Error;
    fn try_from(raw: RawFenceBlock) -> Result<Self> {
        match (raw.descriptor, raw.host) {
            (Some(d), None) => FenceBlock::new(Descriptor::from_value(&d)?, raw.words),
            (None, Some(h)) => FenceBlock::host(h.fd, h.pid, h.id, raw.words),
            (Some(_), Some(_)) => Err(Error::arg(
                "fence block",
                "it has both `descriptor` (device words) and `host` (host words); it needs one",
            )),
            (None, None) => Err(Error::arg(
                "fence block",
                "it has neither `descriptor` (device words) nor `host` (host words)",
            )),
        }
    }
}

impl From<FenceBlock> for RawFenceBlock {
    fn from(b: FenceBlock) -> Self {
        let (descriptor, host) = match b.placement {
            Placement::Device(d) => (Some(d.to_value()), None),
            Placement::Host { fd, pid, id } => (None, Some(RawHost { fd, pid, id })),
        };
        RawFenceBlock {
            descriptor,
            host,
            words: b.words,
        }
    }
}

impl FenceBlock {
    /// A record of device words, checked as decoding checks it.
    pub fn new(descriptor: Descriptor, words: u32) -> Result<Self> {
        let b = FenceBlock {
            placement: Placement::Device(Box::new(descriptor)),
            words,
        };
        b.validate()?;
        Ok(b)
    }

    /// A record of host words: the memfd is descriptor `fd` of process
    /// `pid`, and the block's identity is `id`.
    pub fn host(fd: i32, pid: u32, id: u64, words: u32) -> Result<Self> {
        let b = FenceBlock {
            placement: Placement::Host { fd, pid, id },
            words,
        };
        b.validate()?;
        Ok(b)
    }

    pub(super) fn validate(&self) -> Result<()> {
        let bad = |reason: String| Error::arg("fence block", reason);
        if self.words == 0 || self.words > MAX_WORDS {
            return Err(bad(format!(
                "{} words is outside 1..={MAX_WORDS}",
                self.words
            )));
        }
        let d = match &self.placement {
            Placement::Host { fd, pid, .. } => {
                if *fd < 0 {
                    return Err(bad(format!("{fd} is not a file descriptor number")));
                }
                if *pid == 0 {
                    return Err(bad("process id 0 names no exporting process".into()));
                }
                return Ok(());
            }
            Placement::Device(d) => d,
        };
        d.validate()?;
        if d.dtype != Dtype::U64 {
            return Err(bad(format!(
                "its descriptor holds {}, not u64 sequence words",
                d.dtype
            )));
        }
        if d.byte_len != u64::from(self.words) * WORD {
            return Err(bad(format!(
                "its descriptor exports {} bytes, not {} words of 8 bytes",
                d.byte_len, self.words
            )));
        }
        if !d.offset.is_multiple_of(WORD) {
            return Err(bad(format!("offset {} is not 8-byte aligned", d.offset)));
        }
        if d.generation.is_none() {
            return Err(bad(
                "its descriptor has no generation, which is the block's identity".into(),
            ));
        }
        Ok(())
    }

    /// The block's descriptor, for device words.
    pub fn descriptor(&self) -> Option<&Descriptor> {
        match &self.placement {
            Placement::Device(d) => Some(d),
            Placement::Host { .. } => None,
        }
    }

    /// Whether the words live in host memory.
    pub fn is_host(&self) -> bool {
        matches!(self.placement, Placement::Host { .. })
    }

    /// The number of sequence words.
    pub fn words(&self) -> u32 {
        self.words
    }

    /// The block's identity (for device words, its allocation's generation),
    /// which every [`FenceRef`] to it names.
    pub fn id(&self) -> u64 {
        match &self.placement {
            Placement::Device(d) => d.generation.unwrap_or_default(),
            Placement::Host { id, .. } => *id,
        }
    }
}

/// Which word of which block to wait on, and for which sequence number:
/// what a publish carries. Serialises as `{"block": id, "word": i, "seq":
/// n}`; decoding refuses unknown fields, a sequence number outside
/// `1..=2^62 - 1` and a word index of 2^16 or more (the most words a block
/// holds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawFenceRef", into = "RawFenceRef")]
pub struct FenceRef {
    /// The block's identity ([`FenceBlock::id`]).
    pub block: u64,
    /// The word's index in the block.
    pub word: u32,
    /// The sequence number to wait for.
    pub seq: u64,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFenceRef {
    block: u64,
    word: u32,
    seq: u64,
}

impl TryFrom<RawFenceRef> for FenceRef {
    type Error = Error;
    fn try_from(raw: RawFenceRef) -> Result<Self> {
        check_word(raw.word, MAX_WORDS)?;
        check_seq(raw.seq)?;
        Ok(FenceRef {
            block: raw.block,
            word: raw.word,
            seq: raw.seq,
        })
    }
}

impl From<FenceRef> for RawFenceRef {
    fn from(r: FenceRef) -> Self {
        RawFenceRef {
            block: r.block,
            word: r.word,
            seq: r.seq,
        }
    }
}
