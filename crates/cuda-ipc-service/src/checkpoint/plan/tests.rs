//! The planner's properties, over random tensor lists and options.

use proptest::prelude::*;

use super::*;
use crate::descriptor::Dtype;

/// Tensors laid one after another in up to three files (with the bytes of
/// a header before each file's first), in an order shuffled across files.
fn tensors() -> impl Strategy<Value = Vec<TensorEntry>> {
    prop::collection::vec(
        (
            prop::sample::select(Dtype::ALL.to_vec()),
            prop::collection::vec(0u64..40, 0..3),
            0usize..3,
        ),
        0..40,
    )
    .prop_map(|specs| {
        let mut at = [8u64 + 100, 8 + 7, 8 + 4096];
        specs
            .into_iter()
            .enumerate()
            .map(|(i, (dtype, shape, file))| {
                let len = shape.iter().product::<u64>() * dtype.size();
                let start = at[file];
                at[file] += len;
                TensorEntry {
                    name: format!("t{i}"),
                    dtype,
                    shape,
                    file,
                    range: start..start + len,
                }
            })
            .collect()
    })
}

fn options() -> impl Strategy<Value = PlanOptions> {
    (0u32..10, 1u64..64, 1u64..5000, 1usize..9).prop_map(|(a, units, piece, streams)| {
        let alignment = 1u64 << a;
        PlanOptions::default()
            .with_alignment(alignment)
            .with_chunk_size(alignment * units * 8)
            .with_piece_size(piece)
            .with_streams(streams)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn pieces_cover_each_tensor_exactly_once(ts in tensors(), o in options()) {
        let plan = Plan::new(&ts, &o).unwrap();
        prop_assert_eq!(plan.placements().len(), ts.len());
        for (i, t) in ts.iter().enumerate() {
            let p = plan.placements()[i];
            prop_assert_eq!(p.tensor, i);
            prop_assert_eq!(p.len, t.len());
            let mut pieces: Vec<&Piece> = plan.pieces().iter().filter(|x| x.tensor == i).collect();
            pieces.sort_by_key(|x| x.file_offset);
            // The file range, tiled with no gap and no overlap ...
            let mut file_at = t.range.start;
            for x in &pieces {
                prop_assert_eq!(x.file, t.file);
                prop_assert_eq!(x.file_offset, file_at);
                prop_assert!(x.len >= 1 && x.len <= o.piece_size);
                // ... landing at the same offset in the tensor's place.
                prop_assert_eq!(x.chunk, p.chunk);
                prop_assert_eq!(x.chunk_offset - p.offset, x.file_offset - t.range.start);
                file_at += x.len;
            }
            prop_assert_eq!(file_at, t.range.end);
        }
    }

    #[test]
    fn no_piece_crosses_its_tensor_or_its_chunk(ts in tensors(), o in options()) {
        let plan = Plan::new(&ts, &o).unwrap();
        for x in plan.pieces() {
            let t = &ts[x.tensor];
            let p = plan.placements()[x.tensor];
            prop_assert!(x.file_offset + x.len <= t.range.end);
            prop_assert!(x.chunk_offset + x.len <= p.offset + p.len);
            prop_assert!(x.chunk_offset + x.len <= plan.chunks()[x.chunk].len);
        }
        // Placements in one chunk do not overlap, and stay in it.
        for (c, chunk) in plan.chunks().iter().enumerate() {
            let mut end = 0;
            for p in &plan.placements()[chunk.placements.clone()] {
                prop_assert_eq!(p.chunk, c);
                prop_assert!(p.offset >= end);
                end = p.offset + p.len;
            }
            prop_assert!(end <= chunk.len);
        }
    }

    #[test]
    fn the_layout_respects_alignment_and_chunk_size(ts in tensors(), o in options()) {
        let plan = Plan::new(&ts, &o).unwrap();
        for p in plan.placements() {
            prop_assert_eq!(p.offset % o.alignment, 0);
        }
        for c in plan.chunks() {
            prop_assert_eq!(c.len % o.alignment, 0);
            prop_assert!(c.len >= o.alignment);
            // Over the size only for a tensor on its own.
            if c.len > o.chunk_size {
                prop_assert_eq!(c.placements.len(), 1);
            }
        }
        // The arena's default, reused.
        prop_assert_eq!(PlanOptions::default().alignment, DEFAULT_ALIGNMENT);
    }

    #[test]
    fn totals_match(ts in tensors(), o in options()) {
        let plan = Plan::new(&ts, &o).unwrap();
        let payload: u64 = ts.iter().map(TensorEntry::len).sum();
        prop_assert_eq!(plan.payload_bytes(), payload);
        prop_assert_eq!(plan.pieces().iter().map(|x| x.len).sum::<u64>(), payload);
        prop_assert_eq!(plan.total_bytes(), plan.chunks().iter().map(|c| c.len).sum::<u64>());
        prop_assert!(plan.total_bytes() >= payload);
        let per_stream: u64 = (0..o.streams)
            .map(|s| plan.stream_pieces(s).map(|x| x.len).sum::<u64>())
            .sum();
        prop_assert_eq!(per_stream, payload);
        for (i, x) in plan.pieces().iter().enumerate() {
            prop_assert_eq!(x.stream, i % o.streams);
        }
        // Chunks cover the placements in order, with none left out.
        let covered: usize = plan.chunks().iter().map(|c| c.placements.len()).sum();
        prop_assert_eq!(covered, ts.len());
    }
}

fn tensor(len: u64) -> TensorEntry {
    TensorEntry {
        name: "t".into(),
        dtype: Dtype::U8,
        shape: vec![len],
        file: 0,
        range: 8..8 + len,
    }
}

#[test]
fn a_small_layout_by_hand() {
    let ts = [tensor(10), tensor(300), tensor(0), tensor(1000), tensor(5)];
    let o = PlanOptions::default()
        .with_chunk_size(1024)
        .with_piece_size(256)
        .with_streams(2);
    let plan = Plan::new(&ts, &o).unwrap();
    let at: Vec<(usize, u64)> = plan
        .placements()
        .iter()
        .map(|p| (p.chunk, p.offset))
        .collect();
    assert_eq!(at, [(0, 0), (0, 256), (0, 768), (1, 0), (2, 0)]);
    assert_eq!(plan.chunks()[0].len, 768);
    assert_eq!(plan.chunks()[1].len, 1024);
    assert_eq!(plan.chunks()[2].len, 256);
    let lens: Vec<u64> = plan.pieces().iter().map(|p| p.len).collect();
    assert_eq!(lens, [10, 256, 44, 256, 256, 256, 232, 5]);
    assert_eq!(plan.total_bytes(), 2048);
    assert_eq!(plan.payload_bytes(), 1315);
}
