//! Entry tables a reader decoded and checked before. A subscriber that
//! attaches sets of one layout again (a model published again where it
//! was, or double-buffered weights that alternate between two places)
//! reads each table once: a record whose table text and chunk table are
//! those of a table kept here shares its checked entries, skipping the
//! base64, the table's decoding and the entries' checks (names, sizes,
//! places, overlaps), which depend on nothing else.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::{ArenaId, SetChunk, SetEntry, TableRef};

/// What an entry table's checks depend on besides its text, per chunk in
/// the record's order: its id, its offset in its allocation, its length.
fn chunk_key(c: &SetChunk) -> (u64, u64, u64) {
    (c.id, c.descriptor.offset, c.descriptor.byte_len)
}

struct Table {
    text: Box<str>,
    /// The arena and the [`TableRef`] it came under (format 3).
    named: Option<(ArenaId, TableRef)>,
    chunks: Vec<(u64, u64, u64)>,
    entries: Arc<[SetEntry]>,
}

impl Table {
    fn over(&self, chunks: &[SetChunk]) -> bool {
        self.chunks.len() == chunks.len()
            && self
                .chunks
                .iter()
                .zip(chunks)
                .all(|(k, c)| *k == chunk_key(c))
    }
}

/// The entry tables (set format 2) decoded and checked last: at most
/// [`EntryTables::KEPT`] of them, holding at most
/// [`EntryTables::MAX_TEXT_BYTES`] of table text and
/// [`EntryTables::MAX_ENTRIES`] entries together; the most recently used
/// first.
#[derive(Default)]
pub struct EntryTables {
    recent: Mutex<VecDeque<Table>>,
    hits: AtomicU64,
}

impl std::fmt::Debug for EntryTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kept, bytes) = self.usage();
        f.debug_struct("EntryTables")
            .field("kept", &kept)
            .field("text_bytes", &bytes)
            .field("hits", &self.hits())
            .finish()
    }
}

impl EntryTables {
    /// The most tables kept.
    pub const KEPT: usize = 4;
    /// The most table text kept, all tables together (a table of 10,000
    /// entries is about 0.5 MB of text).
    pub const MAX_TEXT_BYTES: usize = 8 << 20;
    /// The most entries kept, all tables together (about 100 bytes each
    /// besides their names).
    pub const MAX_ENTRIES: usize = 200_000;

    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The checked entries of the table `text` over `chunks`, if kept.
    pub(super) fn find(&self, text: &str, chunks: &[SetChunk]) -> Option<Arc<[SetEntry]>> {
        self.find_where(|t| *t.text == *text && t.over(chunks))
    }

    /// The checked entries of the table that `arena`'s publisher named
    /// `table` (set format 3), over `chunks`, if kept.
    pub(super) fn find_ref(
        &self,
        arena: ArenaId,
        table: &TableRef,
        chunks: &[SetChunk],
    ) -> Option<Arc<[SetEntry]>> {
        self.find_where(|t| {
            t.named
                .as_ref()
                .is_some_and(|(a, r)| *a == arena && r == table)
                && t.over(chunks)
        })
    }

    /// Forgets every table kept (they named another publisher's entries).
    pub(crate) fn clear(&self) {
        self.recent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    fn find_where(&self, matches: impl Fn(&Table) -> bool) -> Option<Arc<[SetEntry]>> {
        let mut recent = self.recent.lock().unwrap_or_else(PoisonError::into_inner);
        let at = recent.iter().position(matches)?;
        let t = recent.remove(at)?;
        let entries = Arc::clone(&t.entries);
        recent.push_front(t);
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(entries)
    }

    /// Keeps `entries`, decoded from `text` (read through the reference
    /// `named`, if any) and checked over `chunks`, in front; the least
    /// recently used tables go past the limits. A table that alone passes
    /// [`Self::MAX_TEXT_BYTES`] or [`Self::MAX_ENTRIES`] is not kept.
    pub(super) fn keep(
        &self,
        text: &str,
        chunks: &[SetChunk],
        entries: &Arc<[SetEntry]>,
        named: Option<(ArenaId, TableRef)>,
    ) {
        if text.len() > Self::MAX_TEXT_BYTES || entries.len() > Self::MAX_ENTRIES {
            return;
        }
        let mut recent = self.recent.lock().unwrap_or_else(PoisonError::into_inner);
        recent.push_front(Table {
            text: text.into(),
            named,
            chunks: chunks.iter().map(chunk_key).collect(),
            entries: Arc::clone(entries),
        });
        let (mut bytes, mut count) = (0, 0);
        let keep = recent
            .iter()
            .take(Self::KEPT)
            .take_while(|t| {
                bytes += t.text.len();
                count += t.entries.len();
                bytes <= Self::MAX_TEXT_BYTES && count <= Self::MAX_ENTRIES
            })
            .count();
        recent.truncate(keep);
    }

    /// Records that found a kept table so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Tables kept, and their text's bytes.
    pub fn usage(&self) -> (usize, usize) {
        let recent = self.recent.lock().unwrap_or_else(PoisonError::into_inner);
        (recent.len(), recent.iter().map(|t| t.text.len()).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries() -> Arc<[SetEntry]> {
        vec![SetEntry::new(
            "w".into(),
            crate::descriptor::Dtype::U8,
            vec![1],
            1,
            0,
            1,
        )]
        .into()
    }

    #[test]
    fn the_least_recently_used_table_goes_first() {
        let t = EntryTables::new();
        let e = entries();
        for text in ["a", "b", "c", "d"] {
            t.keep(text, &[], &e, None);
        }
        assert!(t.find("a", &[]).is_some(), "a is used again");
        t.keep("e", &[], &e, None);
        assert_eq!(t.usage(), (EntryTables::KEPT, 4));
        assert!(t.find("b", &[]).is_none(), "b was the least recently used");
        for text in ["a", "c", "d", "e"] {
            let found = t
                .find(text, &[])
                .unwrap_or_else(|| panic!("{text} is kept"));
            assert!(Arc::ptr_eq(&found, &e), "the same entries, not a copy");
        }
        assert_eq!(t.hits(), 5);
    }

    #[test]
    fn the_text_kept_stays_within_its_limit() {
        let t = EntryTables::new();
        let e = entries();
        let big = |c: char| c.to_string().repeat(3 << 20);
        for c in ['x', 'y', 'z'] {
            t.keep(&big(c), &[], &e, None);
        }
        // Two of 3 MiB fit in 8 MiB, not three: the oldest went.
        assert_eq!(t.usage(), (2, 6 << 20));
        assert!(t.find(&big('x'), &[]).is_none());
        assert!(t.find(&big('z'), &[]).is_some());
        // A table longer than the whole limit is not kept at all.
        t.keep(&"w".repeat(EntryTables::MAX_TEXT_BYTES + 1), &[], &e, None);
        assert_eq!(t.usage(), (2, 6 << 20));
    }

    #[test]
    fn the_entries_kept_stay_within_their_limit() {
        let t = EntryTables::new();
        let many = |n: usize| -> Arc<[SetEntry]> { vec![entries()[0].clone(); n].into() };
        t.keep("a", &[], &many(EntryTables::MAX_ENTRIES / 2), None);
        t.keep("b", &[], &many(EntryTables::MAX_ENTRIES / 2), None);
        assert_eq!(t.usage().0, 2);
        t.keep("c", &[], &many(1), None);
        assert_eq!(t.usage().0, 2, "a went: three pass the limit");
        assert!(t.find("a", &[]).is_none());
        t.keep("d", &[], &many(EntryTables::MAX_ENTRIES + 1), None);
        assert!(t.find("d", &[]).is_none(), "too many entries alone");
        assert_eq!(t.usage().0, 2);
    }
}
