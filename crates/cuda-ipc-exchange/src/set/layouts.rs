//! Set layouts a publisher described before. A publisher that publishes
//! sets of one layout again (a model published again where it is, a
//! writer's next version in the same places, double-buffered weights that
//! alternate between two places) checks and encodes each layout once: a
//! set whose members are, in order, those of a kept layout (the same
//! names, types, shapes, chunks, offsets and lengths, over the same chunk
//! table) shares its checked entries and their encoded table, skipping
//! the entries' allocation, their checks (names, sizes, places, overlaps)
//! and the base64 table, which depend on nothing else. Comparing a set
//! with a kept layout allocates nothing.
//!
//! The subscriber's side of the same idea is [`EntryTables`](super::EntryTables).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use super::{ArenaId, SetChunk, SetEntry, SetRecord, table};
use crate::descriptor::Dtype;
use crate::error::Result;

/// The next [`SetLayout::id`].
static NEXT_LAYOUT_ID: AtomicU64 = AtomicU64::new(1);

/// One member of a set as a publisher describes it, borrowed from the
/// caller: what its [`SetEntry`] will hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemberPlace<'a> {
    /// The entry's name.
    pub name: &'a str,
    /// Its element type.
    pub dtype: Dtype,
    /// Its dimensions.
    pub shape: &'a [u64],
    /// The id of its chunk in the arena.
    pub chunk: u64,
    /// Its byte offset in the chunk.
    pub offset: u64,
    /// Its length in bytes.
    pub len: u64,
}

impl<'a> From<&'a SetEntry> for MemberPlace<'a> {
    /// The member that `entry` describes.
    fn from(e: &'a SetEntry) -> Self {
        MemberPlace {
            name: &e.name,
            dtype: e.dtype,
            shape: &e.shape,
            chunk: e.chunk,
            offset: e.offset,
            len: e.len,
        }
    }
}

impl MemberPlace<'_> {
    /// The entry it describes.
    pub fn entry(&self) -> SetEntry {
        SetEntry::new(
            self.name.to_owned(),
            self.dtype,
            self.shape,
            self.chunk,
            self.offset,
            self.len,
        )
    }
}

/// A layout a publisher described: its chunk table, its checked entries,
/// and their base64 table once it was asked for.
#[derive(Debug)]
pub struct SetLayout {
    /// Distinct for every layout this process described.
    id: u64,
    chunks: Vec<SetChunk>,
    entries: Arc<[SetEntry]>,
    table: OnceLock<String>,
}

impl SetLayout {
    /// Its number: distinct for every layout this process described (a
    /// publisher names the entries of its table after it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The checked entries.
    pub fn entries(&self) -> &Arc<[SetEntry]> {
        &self.entries
    }

    /// The entries as the base64 table of set format 2 (made once).
    pub fn table(&self) -> &str {
        self.table.get_or_init(|| table::encode(&self.entries))
    }

    fn holds(&self, chunks: &[SetChunk], places: &[MemberPlace<'_>]) -> bool {
        self.entries.len() == places.len()
            && self.chunks.as_slice() == chunks
            && places
                .iter()
                .zip(self.entries.iter())
                .all(|(p, e)| *p == MemberPlace::from(e))
    }
}

/// The layouts a publisher described last: at most [`SetLayouts::KEPT`]
/// (so at most that many times [`MAX_SET_ENTRIES`](super::MAX_SET_ENTRIES)
/// entries), the most recently used first.
#[derive(Debug, Default)]
pub struct SetLayouts {
    recent: Mutex<VecDeque<Arc<SetLayout>>>,
    hits: AtomicU64,
}

impl SetLayouts {
    /// The most layouts kept (two: double-buffered weights alternate).
    pub const KEPT: usize = 2;

    /// None kept yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The record of a set called `name` in `arena` over `chunks` (each
    /// chunk the members use, once, by id) whose members are `places`, in
    /// order, checked as [`SetRecord::new`] checks it, and its layout (kept
    /// here, or found here: then its entries and table are shared and only
    /// what differs, the name, is checked).
    ///
    /// # Errors
    /// As [`SetRecord::new`].
    pub fn describe(
        &self,
        name: &str,
        arena: ArenaId,
        chunks: Vec<SetChunk>,
        places: &[MemberPlace<'_>],
    ) -> Result<(SetRecord, Arc<SetLayout>)> {
        if let Some(layout) = self.find(&chunks, places) {
            let record = SetRecord {
                name: name.to_owned(),
                arena,
                chunks,
                entries: Arc::clone(&layout.entries),
                event: None,
                read_only: false,
            };
            // The entries were checked over these chunks when kept.
            record.validate_head()?;
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok((record, layout));
        }
        let record = SetRecord::new(
            name.to_owned(),
            arena,
            chunks,
            places.iter().map(MemberPlace::entry).collect(),
        )?;
        let layout = Arc::new(SetLayout {
            id: NEXT_LAYOUT_ID.fetch_add(1, Ordering::Relaxed),
            chunks: record.chunks.clone(),
            entries: Arc::clone(&record.entries),
            table: OnceLock::new(),
        });
        self.keep(Arc::clone(&layout));
        Ok((record, layout))
    }

    /// How many sets were described from a kept layout.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// How many layouts are kept, and their entries together.
    pub fn usage(&self) -> (usize, usize) {
        let recent = self.lock();
        (recent.len(), recent.iter().map(|l| l.entries.len()).sum())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Arc<SetLayout>>> {
        // Nothing that holds the lock panics part way.
        self.recent.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn find(&self, chunks: &[SetChunk], places: &[MemberPlace<'_>]) -> Option<Arc<SetLayout>> {
        let mut recent = self.lock();
        let at = recent.iter().position(|l| l.holds(chunks, places))?;
        let layout = recent.remove(at)?;
        recent.push_front(Arc::clone(&layout));
        Some(layout)
    }

    fn keep(&self, layout: Arc<SetLayout>) {
        let mut recent = self.lock();
        recent.push_front(layout);
        recent.truncate(Self::KEPT);
    }
}

#[cfg(test)]
#[path = "layouts_tests.rs"]
mod tests;
