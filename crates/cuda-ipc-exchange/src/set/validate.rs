//! The checks of a set record's chunk table and entries, for
//! [`SetRecord::validate`]: every chunk of one mechanism and device, every
//! entry inside its chunk, no two entries overlapping or sharing a name.

use super::decode::{check_name, field_err};
use super::{
    ChunkPositions, Dtype, EntryField, HashSet, MAX_SET_CHUNKS, MAX_SET_DIMS, MAX_SET_ENTRIES,
    Result, SetEntry, SetRecord, nested,
};

/// Checks the chunk table; returns each chunk's position by id.
pub(super) fn chunks(record: &SetRecord) -> Result<ChunkPositions> {
    if record.chunks.is_empty() {
        return Err(field_err("chunks", "a set needs at least one chunk"));
    }
    if record.chunks.len() > MAX_SET_CHUNKS {
        return Err(field_err(
            "chunks",
            format!(
                "{} chunks is more than the {MAX_SET_CHUNKS} allowed",
                record.chunks.len()
            ),
        ));
    }
    let first = &record.chunks[0].descriptor;
    let mut by_id = ChunkPositions::with_capacity_and_hasher(
        record.chunks.len(),
        foldhash::fast::RandomState::default(),
    );
    for (i, c) in record.chunks.iter().enumerate() {
        let at = |field: &str| format!("chunks[{i}].{field}");
        let d = &c.descriptor;
        d.validate()
            .map_err(|e| nested(&format!("chunks[{i}].descriptor"), e))?;
        if let Some(j) = by_id.insert(c.id, i) {
            return Err(field_err(
                &at("id"),
                format!("chunk {} is also chunks[{j}]", c.id),
            ));
        }
        if d.dtype != Dtype::U8 || d.shape.is_some() || d.strides.is_some() {
            return Err(field_err(
                &at("descriptor.dtype"),
                "a chunk is described as bytes (dtype u8, no shape or strides); entries carry the types",
            ));
        }
        if d.event.is_some() {
            return Err(field_err(
                &at("descriptor.event"),
                "chunks carry no event; the set's event goes in the set's `event` field",
            ));
        }
        let same = [
            (d.mechanism() == first.mechanism(), "mechanism"),
            (d.device_uuid == first.device_uuid, "device_uuid"),
            (d.pid == first.pid, "pid"),
        ];
        if let Some((_, field)) = same.iter().find(|(ok, _)| !ok) {
            return Err(field_err(
                &at(&format!("descriptor.{field}")),
                "differs from chunks[0]: a set's chunks come from one arena",
            ));
        }
        if let Some(j) = record.chunks[..i]
            .iter()
            .position(|o| o.descriptor.source == d.source)
        {
            return Err(field_err(
                &at("descriptor"),
                format!("names the same memory as chunks[{j}]"),
            ));
        }
    }
    Ok(by_id)
}

/// Checks every entry and that no two overlap or share a name.
pub(super) fn entries(record: &SetRecord, chunks: &ChunkPositions) -> Result<()> {
    if record.entries.is_empty() {
        return Err(field_err("entries", "a set needs at least one entry"));
    }
    if record.entries.len() > MAX_SET_ENTRIES {
        return Err(field_err(
            "entries",
            format!(
                "{} entries is more than the {MAX_SET_ENTRIES} allowed",
                record.entries.len()
            ),
        ));
    }
    let mut names: HashSet<&str, foldhash::fast::RandomState> = HashSet::with_capacity_and_hasher(
        record.entries.len(),
        foldhash::fast::RandomState::default(),
    );
    // Each entry's (offset, end, index), grouped by its chunk's position
    // (a counting sort: the chunks are few), then in offset order within
    // each chunk, where overlaps are looked for.
    let mut spans: Vec<(usize, u64, u64, usize)> = Vec::with_capacity(record.entries.len());
    let mut starts = vec![0usize; record.chunks.len() + 1];
    for (i, e) in record.entries.iter().enumerate() {
        if !names.insert(e.name.as_str()) {
            return Err(field_err(
                &format!("entries[{i}].name"),
                format!("{:?} names another entry too", e.name),
            ));
        }
        let (c, end) = check_entry(record, i, e, chunks)?;
        starts[c + 1] += 1;
        spans.push((c, e.offset, end, i));
    }
    if let Some(c) = starts[1..].iter().position(|&n| n == 0) {
        return Err(field_err(
            &format!("chunks[{c}]"),
            format!("no entry uses chunk {}", record.chunks[c].id),
        ));
    }
    for c in 1..starts.len() {
        starts[c] += starts[c - 1];
    }
    let mut by_chunk = vec![(0u64, 0u64, 0usize); spans.len()];
    let mut next = starts.clone();
    for &(c, offset, end, i) in &spans {
        by_chunk[next[c]] = (offset, end, i);
        next[c] += 1;
    }
    for (c, w) in starts.windows(2).enumerate() {
        let placed = &mut by_chunk[w[0]..w[1]];
        // Usually in order already (an arena hands out ranges in order).
        if !placed.is_sorted() {
            placed.sort_unstable();
        }
        for pair in placed.windows(2) {
            let ((o0, e0, i0), (o1, e1, i1)) = (pair[0], pair[1]);
            if o1 < e0 {
                let (first, second) = (i0.min(i1), i0.max(i1));
                let (a, b) = if i0 < i1 {
                    ((o0, e0), (o1, e1))
                } else {
                    ((o1, e1), (o0, e0))
                };
                return Err(field_err(
                    &format!("entries[{second}].offset"),
                    format!(
                        "bytes {}..{} overlap entries[{first}] ({:?}, bytes {}..{}) in chunk {}",
                        b.0, b.1, record.entries[first].name, a.0, a.1, record.chunks[c].id
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Checks one entry on its own; returns its chunk's position and its end.
fn check_entry(
    record: &SetRecord,
    i: usize,
    e: &SetEntry,
    chunks: &ChunkPositions,
) -> Result<(usize, u64)> {
    let at = |field: &str| format!("entries[{i}].{field}");
    check_name(EntryField(i, Some("name")), &e.name)?;
    if e.shape.len() > MAX_SET_DIMS {
        return Err(field_err(
            &at("shape"),
            format!(
                "{} dimensions is more than the {MAX_SET_DIMS} allowed",
                e.shape.len()
            ),
        ));
    }
    let elem = e.dtype.size();
    let bytes = e
        .shape
        .iter()
        .try_fold(1u64, |a, d| a.checked_mul(*d))
        .and_then(|n| n.checked_mul(elem))
        .ok_or_else(|| field_err(&at("shape"), "the size in bytes overflows"))?;
    if e.len == 0 {
        return Err(field_err(&at("len"), "must be greater than zero"));
    }
    if bytes != e.len {
        return Err(field_err(
            &at("len"),
            format!(
                "{} bytes, but shape {:?} of {} holds {bytes}",
                e.len, e.shape, e.dtype
            ),
        ));
    }
    let &c = chunks.get(&e.chunk).ok_or_else(|| {
        field_err(
            &at("chunk"),
            format!("{} is not the id of a chunk in the table", e.chunk),
        )
    })?;
    // Aligned where the elements really start: the chunk's own offset
    // in its allocation counts too.
    let start = record.chunks[c].descriptor.offset.checked_add(e.offset);
    if !start.is_some_and(|s| s.is_multiple_of(elem)) {
        return Err(field_err(
            &at("offset"),
            format!(
                "{} (byte {} of chunk {}'s allocation) is not aligned to the {elem}-byte {} \
                 elements",
                e.offset,
                start.map_or_else(|| "past 2^64".to_string(), |s| s.to_string()),
                e.chunk,
                e.dtype
            ),
        ));
    }
    let size = record.chunks[c].descriptor.byte_len;
    let end = e
        .offset
        .checked_add(e.len)
        .filter(|end| *end <= size)
        .ok_or_else(|| {
            field_err(
                &at("len"),
                format!(
                    "offset {} + len {} passes the end of chunk {} ({size} bytes)",
                    e.offset, e.len, e.chunk
                ),
            )
        })?;
    Ok((c, end))
}
