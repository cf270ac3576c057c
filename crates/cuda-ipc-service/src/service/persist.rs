//! The service's side of weights that outlive it (see [`crate::keep`]):
//! after every change of what it serves, the chunks and a catalog image go
//! to the store; at start, what the store handed back is served again.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsFd, OwnedFd};
use std::str::FromStr;

use crate::arena::{DeviceArenaBuffer, KeptChunk, SetMember};
use crate::descriptor::Dtype;
use crate::error::{Error, Result};
use crate::keep::Store;
use crate::keep::image::{
    self, BufferImage, ChunkImage, FORMAT, Image, SetImage, Stored, TensorImage,
};
use crate::keep::store::{read_sealed, sealed};
use crate::set::ArenaId;

use super::catalog::SetInfo;
use super::layout::Tensor;
use super::{Held, Inner, locked};

/// The store and the number of the last image sent to it.
#[derive(Debug, Default)]
pub(super) struct Keeping {
    pub(super) store: Store,
    seq: u64,
}

impl Keeping {
    pub(super) fn new(store: Store) -> Keeping {
        Keeping { store, seq: 0 }
    }
}

/// What [`Service::start_kept`](super::Service::start_kept) served again.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Restored {
    /// The sets served again, with their versions.
    pub sets: Vec<(String, u64)>,
    /// Bytes of device memory taken back (the chunks).
    pub chunk_bytes: u64,
    /// The catalog image's number (0: none was kept).
    pub image: u64,
}

fn keep_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Io {
        context: format!("the kept weights: {what}"),
        source: std::io::Error::other(e.to_string()),
    }
}

impl Inner {
    /// Sends the store what a restart needs to serve what is served now.
    /// Failures are logged: the service serves on, and a restart then
    /// serves the last image that reached the store.
    pub(super) fn persist(&self) {
        let mut keeping = locked(&self.keeping);
        if !keeping.store.is_kept() {
            return;
        }
        if let Err(e) = self.persist_locked(&mut keeping) {
            tracing::warn!(error = %e, "cannot keep the catalog outside the serving process");
        }
    }

    /// Every set's books, and the sets a restart finds torn: those torn,
    /// and those written in place now (until their commit).
    fn kept_infos(&self) -> (BTreeMap<String, SetInfo>, BTreeSet<String>) {
        let catalog = locked(&self.catalog);
        let infos = catalog
            .sets()
            .map(|s| (s.name.clone(), s.clone()))
            .collect();
        let torn = catalog
            .sets()
            .filter(|s| {
                catalog.is_torn(&s.name) || catalog.writing(&s.name).is_some_and(|w| w.in_place)
            })
            .map(|s| s.name.clone())
            .collect();
        (infos, torn)
    }

    fn persist_locked(&self, keeping: &mut Keeping) -> std::io::Result<()> {
        let (infos, torn) = self.kept_infos();
        let held = locked(&self.held);
        let arena = match self.publisher.arena() {
            Ok(a) => a.id(),
            Err(_) => return Ok(()),
        };
        let mut chunks: BTreeMap<u64, (u64, OwnedFd)> = BTreeMap::new();
        let mut sets = Vec::new();
        for (name, h) in held.iter() {
            let Some(info) = infos.get(name) else {
                continue;
            };
            let mut buffers = Vec::new();
            for b in h.buffers() {
                let chunk = b.chunk();
                let index = chunk.id().index;
                if let std::collections::btree_map::Entry::Vacant(e) = chunks.entry(index) {
                    let Some(fd) = chunk.backing().fds().first() else {
                        return Err(std::io::Error::other("a chunk without a file descriptor"));
                    };
                    e.insert((chunk.byte_len(), fd.try_clone()?));
                }
                buffers.push(BufferImage {
                    chunk: index,
                    offset: b.offset(),
                    len: b.byte_len(),
                });
            }
            let tensors = h
                .tensors
                .iter()
                .zip(&h.places)
                .map(|(t, &(buffer, offset))| TensorImage {
                    name: t.name.clone(),
                    dtype: t.dtype.name().to_string(),
                    shape: t.shape.clone(),
                    buffer,
                    offset,
                    len: t.bytes,
                })
                .collect();
            sets.push(SetImage {
                name: name.clone(),
                version: info.version,
                owner_uid: info.owner_uid,
                bytes: info.bytes,
                payload_bytes: info.payload_bytes,
                loaded_from: info.loaded_from.clone(),
                created_unix: info.created_unix,
                restarts: h.restarts,
                torn: torn.contains(name),
                buffers,
                tensors,
            });
        }
        drop(held);
        let store = &mut keeping.store;
        // Chunks first, then the image that names them, then what no image
        // needs any more: a crash between any two steps leaves a store that
        // serves the last image that reached it.
        for (index, (_, fd)) in &chunks {
            let name = image::chunk_name(*index);
            if !store.holds(&name) {
                store.put(&name, fd.as_fd())?;
            }
        }
        keeping.seq += 1;
        let image = Image {
            format: FORMAT,
            seq: keeping.seq,
            arena: arena.0,
            chunks: chunks
                .iter()
                .map(|(&index, (len, _))| ChunkImage { index, len: *len })
                .collect(),
            sets,
        };
        let memfd = sealed("cuda-ipc-catalog", &image.encode())?;
        let current = image::image_name(keeping.seq);
        store.put(&current, memfd.as_fd())?;
        let stale: Vec<String> = store
            .names()
            .filter(|n| match image::parse_name(n) {
                Some(Stored::Image(_)) => *n != current,
                Some(Stored::Chunk(i)) => !chunks.contains_key(&i),
                _ => false,
            })
            .map(str::to_string)
            .collect();
        for name in stale {
            store.remove(&name)?;
        }
        Ok(())
    }

    /// Takes the readers' book the store handed back: the readers of the
    /// process before are waited for by writes in place until they connect
    /// again (`service/readers.rs`).
    fn adopt_readers(&self, fd: OwnedFd) {
        match locked(&self.readers).adopt(fd) {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                readers = n,
                "readers of the serving process before: writes in place wait for each to connect again or exit"
            ),
            Err(e) => tracing::error!(
                error = %e,
                "the kept readers' book does not read: readers of the process before are not known, and a write in place does not wait for them"
            ),
        }
    }

    /// Under a store, makes the readers' book and gives it to the store,
    /// unless the store handed one back.
    pub(super) fn keep_readers(&self) {
        if !locked(&self.keeping).store.is_kept() {
            return;
        }
        let made = {
            let mut readers = locked(&self.readers);
            if readers.is_kept() {
                return;
            }
            readers.create().and_then(|fd| fd.try_clone_to_owned())
        };
        let kept = made.and_then(|fd| {
            locked(&self.keeping)
                .store
                .put(super::readers::KEPT_NAME, fd.as_fd())
        });
        if let Err(e) = kept {
            tracing::warn!(error = %e, "cannot keep the readers' book: after a restart, a write in place does not wait for readers that have not connected again");
        }
    }

    /// Serves again what the store handed back at start: the newest image
    /// that reads, its chunks taken back into the publisher's arena, each
    /// set published at its version. Sets whose chunks did not come back
    /// are left out and named in the log. Called before the service
    /// answers any call.
    ///
    /// # Errors
    /// Taking the chunks back (the driver's), or publishing a set again.
    pub(super) fn restore(&self) -> Result<Restored> {
        let received = locked(&self.keeping).store.take_received();
        let mut images = Vec::new();
        let mut chunk_fds: BTreeMap<u64, OwnedFd> = BTreeMap::new();
        let mut socket = None;
        for (name, fd) in received {
            match image::parse_name(&name) {
                Some(Stored::Image(seq)) => images.push((seq, fd)),
                Some(Stored::Chunk(i)) => {
                    chunk_fds.insert(i, fd);
                }
                Some(Stored::Socket) => socket = Some(fd),
                Some(Stored::Readers) => self.adopt_readers(fd),
                None => tracing::warn!(
                    name,
                    "the store handed back a descriptor of no known name; closed"
                ),
            }
        }
        drop(socket);
        images.sort_by_key(|(seq, _)| std::cmp::Reverse(*seq));
        let mut chosen = None;
        for (seq, fd) in images {
            match read_sealed(&fd)
                .map_err(|e| e.to_string())
                .and_then(|b| Image::decode(&b))
            {
                Ok(image) => {
                    chosen = Some(image);
                    break;
                }
                Err(e) => {
                    tracing::error!(seq, error = %e, "a kept catalog image does not read; trying an older one");
                }
            }
        }
        let Some(image) = chosen else {
            return Ok(Restored::default());
        };
        locked(&self.keeping).seq = image.seq;
        let mut restored = Restored {
            image: image.seq,
            ..Restored::default()
        };
        // Sets whose every chunk came back; the ranges each chunk keeps.
        let whole: Vec<&SetImage> = image
            .sets
            .iter()
            .filter(|s| {
                let ok = s.buffers.iter().all(|b| chunk_fds.contains_key(&b.chunk));
                if !ok {
                    tracing::error!(set = %s.name, version = s.version, "a chunk of this set did not come back from the store; it is not served");
                }
                ok
            })
            .collect();
        let mut ranges: BTreeMap<u64, Vec<(usize, usize)>> = BTreeMap::new();
        for (si, s) in whole.iter().enumerate() {
            for (bi, b) in s.buffers.iter().enumerate() {
                ranges.entry(b.chunk).or_default().push((si, bi));
            }
        }
        let lens: BTreeMap<u64, u64> = image.chunks.iter().map(|c| (c.index, c.len)).collect();
        let mut order = Vec::new();
        let mut chunks = Vec::new();
        for (index, places) in &ranges {
            let fd = chunk_fds.remove(index).expect("checked above");
            let len = lens[index];
            restored.chunk_bytes += len;
            let r = places
                .iter()
                .map(|&(si, bi)| (whole[si].buffers[bi].offset, whole[si].buffers[bi].len))
                .collect();
            chunks.push(KeptChunk::new(*index, fd, len, r));
            order.push(places.clone());
        }
        drop(chunk_fds);
        let buffers = self
            .publisher
            .restore_arena(ArenaId(image.arena), chunks)
            .map_err(|e| keep_error("taking the chunks back", e))?;
        let mut per_set: Vec<Vec<Option<DeviceArenaBuffer>>> = whole
            .iter()
            .map(|s| (0..s.buffers.len()).map(|_| None).collect())
            .collect();
        for (places, got) in order.into_iter().zip(buffers) {
            for ((si, bi), b) in places.into_iter().zip(got) {
                per_set[si][bi] = Some(b);
            }
        }
        for (s, bufs) in whole.iter().zip(per_set) {
            let bufs: Vec<DeviceArenaBuffer> = bufs.into_iter().flatten().collect();
            self.serve_again(s, bufs)?;
            restored.sets.push((s.name.clone(), s.version));
        }
        Ok(restored)
    }

    /// Publishes one restored set and puts it in the books.
    fn serve_again(&self, s: &SetImage, buffers: Vec<DeviceArenaBuffer>) -> Result<()> {
        let mut tensors = Vec::with_capacity(s.tensors.len());
        let mut places = Vec::with_capacity(s.tensors.len());
        for t in &s.tensors {
            tensors.push(Tensor {
                name: t.name.clone(),
                dtype: Dtype::from_str(&t.dtype)?,
                shape: t.shape.clone(),
                bytes: t.len,
            });
            places.push((t.buffer, t.offset));
        }
        let members: Vec<SetMember<'_>> = tensors
            .iter()
            .zip(&places)
            .map(|(t, &(b, o))| SetMember::new(&t.name, t.dtype, &t.shape, &buffers[b]).at(o))
            .collect();
        self.publisher.publish_set(&s.name, &members)?;
        drop(members);
        locked(&self.catalog).restore(SetInfo {
            name: s.name.clone(),
            owner_uid: s.owner_uid,
            bytes: s.bytes,
            payload_bytes: s.payload_bytes,
            tensors: s.tensors.len(),
            version: s.version,
            loaded_from: s.loaded_from.clone(),
            created_unix: s.created_unix,
        });
        locked(&self.held).insert(
            s.name.clone(),
            Held::restored(tensors, places, buffers, s.restarts + 1),
        );
        if s.torn {
            locked(&self.catalog).mark_torn(&s.name);
            self.refuse_torn(&s.name);
            tracing::warn!(set = %s.name, version = s.version, "an in-place write of this set was cut short by the restart: it is torn");
        }
        tracing::info!(set = %s.name, version = s.version, restarts = s.restarts + 1, "served again after a restart");
        Ok(())
    }

    /// Lets the store close everything (a stop on purpose: the sets are
    /// dropped).
    pub(super) fn forget_kept(&self) {
        let mut keeping = locked(&self.keeping);
        let names: BTreeSet<String> = keeping.store.names().map(str::to_string).collect();
        for name in names {
            if let Err(e) = keeping.store.remove(&name) {
                tracing::debug!(name, error = %e, "cannot remove a kept descriptor");
            }
        }
        let _ = keeping.store.stopping();
    }
}
