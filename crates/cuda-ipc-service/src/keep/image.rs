//! The catalog image: what a restarted service needs to serve the same
//! sets again from the chunks a keeper held (the arena's identity, its
//! chunks' sizes, each set's versions, owner and tensors in the chunks).
//! JSON in a sealed memfd, written by the service alone and read back by
//! the next one, checked as any input: a damaged image is an error that
//! names what is wrong, never a set served from the wrong bytes.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::set::MAX_SET_ENTRIES;

/// The image's format; a service refuses an image of another.
pub(crate) const FORMAT: u32 = 1;

/// The most sets and chunks an image may name (far more than any device
/// holds: each takes at least 2 MiB).
const MAX_SETS: usize = 1 << 16;
const MAX_CHUNKS: usize = 1 << 16;

/// The whole image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Image {
    pub(crate) format: u32,
    /// Numbers the images of one store: the next one is one more.
    pub(crate) seq: u64,
    /// The arena the chunks belong to (`ArenaId`).
    pub(crate) arena: u64,
    /// The chunks the sets use, each stored under [`chunk_name`].
    pub(crate) chunks: Vec<ChunkImage>,
    pub(crate) sets: Vec<SetImage>,
}

/// One chunk: its index in the arena and its size in bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChunkImage {
    pub(crate) index: u64,
    pub(crate) len: u64,
}

/// One set's current version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SetImage {
    pub(crate) name: String,
    pub(crate) version: u64,
    pub(crate) owner_uid: u32,
    pub(crate) bytes: u64,
    pub(crate) payload_bytes: u64,
    pub(crate) loaded_from: String,
    pub(crate) created_unix: u64,
    /// How many restarts of the service this version has been served
    /// through.
    pub(crate) restarts: u64,
    /// Whether an in-place write of it was open or cut short: its bytes
    /// are partly written, and it is served torn (attaches refused).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) torn: bool,
    /// The arena buffers the tensors live in.
    pub(crate) buffers: Vec<BufferImage>,
    pub(crate) tensors: Vec<TensorImage>,
}

/// An arena buffer: a range of a chunk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BufferImage {
    pub(crate) chunk: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// A tensor: its place in one of the set's buffers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TensorImage {
    pub(crate) name: String,
    pub(crate) dtype: String,
    pub(crate) shape: Vec<u64>,
    pub(crate) buffer: usize,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// The name a chunk's descriptor is stored under.
pub(crate) fn chunk_name(index: u64) -> String {
    format!("chunk.{index}")
}

/// The name image `seq` is stored under.
pub(crate) fn image_name(seq: u64) -> String {
    format!("catalog.{seq}")
}

/// What a stored name holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stored {
    Chunk(u64),
    Image(u64),
    /// The channel's listening socket.
    Socket,
    /// The readers' book (`service/readers.rs`).
    Readers,
}

/// The name the channel's listening socket is stored under.
pub(crate) const SOCKET_NAME: &str = "socket";

/// The name the serving process's book of readers is stored under
/// (`service/readers.rs`).
pub(crate) const READERS_NAME: &str = "readers";

/// What `name` holds, if it is one of the service's names.
pub(crate) fn parse_name(name: &str) -> Option<Stored> {
    let number = |s: &str| {
        (!s.is_empty()
            && s.bytes().all(|b| b.is_ascii_digit())
            && (s == "0" || !s.starts_with('0')))
        .then(|| s.parse().ok())
        .flatten()
    };
    if name == SOCKET_NAME {
        Some(Stored::Socket)
    } else if name == READERS_NAME {
        Some(Stored::Readers)
    } else if let Some(i) = name.strip_prefix("chunk.") {
        number(i).map(Stored::Chunk)
    } else if let Some(s) = name.strip_prefix("catalog.") {
        number(s).map(Stored::Image)
    } else {
        None
    }
}

impl Image {
    pub(crate) fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("an image is plain data")
    }

    /// Decodes and checks an image: the format, the bounds, every buffer in
    /// a chunk the image names, every tensor inside its buffer.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Image, String> {
        let image: Image =
            serde_json::from_slice(bytes).map_err(|e| format!("not a catalog image: {e}"))?;
        image.check()?;
        Ok(image)
    }

    fn check(&self) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!(
                "format {} (this build reads format {FORMAT}); start the build that wrote it, \
                 or drop the kept sets",
                self.format
            ));
        }
        if self.sets.len() > MAX_SETS || self.chunks.len() > MAX_CHUNKS {
            return Err(format!(
                "{} sets and {} chunks: more than the {MAX_SETS} and {MAX_CHUNKS} an image holds",
                self.sets.len(),
                self.chunks.len()
            ));
        }
        let mut indices = BTreeSet::new();
        for c in &self.chunks {
            if !indices.insert(c.index) || c.len == 0 {
                return Err(format!("chunk {} is named twice or empty", c.index));
            }
        }
        let mut names = BTreeSet::new();
        for s in &self.sets {
            let at = |why: String| format!("set {:?}: {why}", s.name);
            if !names.insert(s.name.as_str()) {
                return Err(at("named twice".into()));
            }
            if s.tensors.is_empty() || s.tensors.len() > MAX_SET_ENTRIES {
                return Err(at(format!("{} tensors", s.tensors.len())));
            }
            for b in &s.buffers {
                let chunk = self.chunks.iter().find(|c| c.index == b.chunk);
                let fits = chunk.is_some_and(|c| {
                    b.len > 0 && crate::error::Error::check_range(b.offset, b.len, c.len).is_ok()
                });
                if !fits {
                    return Err(at(format!(
                        "a buffer of {} bytes at {} of chunk {} is not inside a chunk the image names",
                        b.len, b.offset, b.chunk
                    )));
                }
            }
            for t in &s.tensors {
                let fits = s.buffers.get(t.buffer).is_some_and(|b| {
                    t.len > 0 && crate::error::Error::check_range(t.offset, t.len, b.len).is_ok()
                });
                if !fits {
                    return Err(at(format!("tensor {:?} is not inside its buffer", t.name)));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Image {
        Image {
            format: FORMAT,
            seq: 3,
            arena: 0xfeed,
            chunks: vec![ChunkImage {
                index: 2,
                len: 4 << 20,
            }],
            sets: vec![SetImage {
                name: "model".into(),
                version: 4,
                owner_uid: 1000,
                bytes: 1 << 20,
                payload_bytes: 1000,
                loaded_from: "/m.safetensors".into(),
                created_unix: 1,
                restarts: 0,
                torn: false,
                buffers: vec![BufferImage {
                    chunk: 2,
                    offset: 256,
                    len: 1 << 20,
                }],
                tensors: vec![TensorImage {
                    name: "w".into(),
                    dtype: "bf16".into(),
                    shape: vec![500],
                    buffer: 0,
                    offset: 0,
                    len: 1000,
                }],
            }],
        }
    }

    #[test]
    fn an_image_reads_back_as_written() {
        let image = sample();
        assert_eq!(Image::decode(&image.encode()).unwrap(), image);
    }

    #[test]
    fn a_damaged_image_is_refused_naming_what_is_wrong() {
        let mut outside = sample();
        outside.sets[0].buffers[0].offset = 4 << 20;
        assert!(
            Image::decode(&outside.encode())
                .unwrap_err()
                .contains("not inside a chunk")
        );
        let mut no_chunk = sample();
        no_chunk.sets[0].buffers[0].chunk = 7;
        assert!(
            Image::decode(&no_chunk.encode())
                .unwrap_err()
                .contains("chunk 7")
        );
        let mut tensor = sample();
        tensor.sets[0].tensors[0].len = 2 << 20;
        assert!(
            Image::decode(&tensor.encode())
                .unwrap_err()
                .contains("\"w\"")
        );
        let mut format = sample();
        format.format = 9;
        assert!(
            Image::decode(&format.encode())
                .unwrap_err()
                .contains("format 9")
        );
        let text = String::from_utf8(sample().encode()).unwrap();
        let extra = text.replacen('{', "{\"x\":1,", 1);
        assert!(
            Image::decode(extra.as_bytes())
                .unwrap_err()
                .contains("unknown field")
        );
        assert!(Image::decode(b"").is_err());
        assert!(Image::decode(&text.as_bytes()[..text.len() / 2]).is_err());
    }

    #[test]
    fn stored_names_are_parsed_strictly() {
        assert_eq!(parse_name("chunk.0"), Some(Stored::Chunk(0)));
        assert_eq!(parse_name("chunk.12"), Some(Stored::Chunk(12)));
        assert_eq!(parse_name("catalog.3"), Some(Stored::Image(3)));
        assert_eq!(parse_name("socket"), Some(Stored::Socket));
        assert_eq!(parse_name("readers"), Some(Stored::Readers));
        for bad in [
            "chunk.", "chunk.01", "chunk.-1", "chunk.1x", "catalog", "other", "",
        ] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
        assert_eq!(parse_name(&chunk_name(5)), Some(Stored::Chunk(5)));
        assert_eq!(parse_name(&image_name(9)), Some(Stored::Image(9)));
    }
}
