//! The staging schedule of one stream: which staging buffer each of its
//! pieces goes through, and which earlier copy must have finished before
//! that buffer is filled again. Pure data, from a [`Plan`].

use crate::checkpoint::Plan;

/// Staging buffers per stream: one is filled while the other's copy runs.
pub(crate) const SLOTS: usize = 2;

/// One piece of a stream's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Step {
    /// The piece: an index into [`Plan::pieces`].
    pub piece: usize,
    /// The staging buffer it goes through (`0..SLOTS`).
    pub slot: usize,
    /// The piece whose copy last read this buffer: it must have finished
    /// before the buffer is filled (`None`: the buffer's first use).
    pub after: Option<usize>,
}

/// The schedule of stream `stream`: its pieces in plan order, through its
/// staging buffers in turn.
pub(crate) fn stream_steps(plan: &Plan, stream: usize) -> Vec<Step> {
    let mut last: [Option<usize>; SLOTS] = [None; SLOTS];
    plan.pieces()
        .iter()
        .enumerate()
        .filter(|(_, p)| p.stream == stream)
        .enumerate()
        .map(|(k, (piece, _))| {
            let slot = k % SLOTS;
            let after = last[slot].replace(piece);
            Step { piece, slot, after }
        })
        .collect()
}

/// The bytes of each staging buffer of `steps`: the largest piece, so that
/// a small checkpoint pins no more than it copies.
pub(crate) fn staging_len(plan: &Plan, steps: &[Step]) -> u64 {
    steps
        .iter()
        .map(|s| plan.pieces()[s.piece].len)
        .max()
        .unwrap_or(0)
}

/// How many staging buffers `steps` use.
pub(crate) fn slots_used(steps: &[Step]) -> usize {
    steps.len().min(SLOTS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{PlanOptions, TensorEntry};
    use crate::descriptor::Dtype;

    fn tensors(lens: &[u64]) -> Vec<TensorEntry> {
        let mut at = 100;
        lens.iter()
            .enumerate()
            .map(|(i, &len)| {
                let t = TensorEntry {
                    name: format!("t{i}"),
                    dtype: Dtype::U8,
                    shape: vec![len],
                    file: i % 2,
                    range: at..at + len,
                };
                at += len;
                t
            })
            .collect()
    }

    fn plan(lens: &[u64], piece: u64, streams: usize) -> Plan {
        let o = PlanOptions::default()
            .with_piece_size(piece)
            .with_streams(streams);
        Plan::new(&tensors(lens), &o).unwrap()
    }

    #[test]
    fn every_piece_once_on_its_own_stream_in_order() {
        let p = plan(&[1000, 1, 513, 0, 4096, 77], 100, 3);
        let mut seen = vec![0; p.pieces().len()];
        for s in 0..3 {
            let steps = stream_steps(&p, s);
            let mut prev = None;
            for st in &steps {
                assert_eq!(p.pieces()[st.piece].stream, s);
                assert!(prev < Some(st.piece), "plan order");
                prev = Some(st.piece);
                seen[st.piece] += 1;
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
    }

    #[test]
    fn a_buffer_is_refilled_only_after_its_last_copy() {
        for streams in 1..5 {
            let p = plan(&[1000, 3, 700, 250, 4096], 128, streams);
            for s in 0..streams {
                let steps = stream_steps(&p, s);
                for (k, st) in steps.iter().enumerate() {
                    assert_eq!(st.slot, k % SLOTS);
                    // The buffer's previous user is the step SLOTS before.
                    let want = k.checked_sub(SLOTS).map(|j| steps[j].piece);
                    assert_eq!(st.after, want, "stream {s} step {k}");
                    if let Some(a) = st.after {
                        assert!(a < st.piece);
                        assert_eq!(steps[k - SLOTS].slot, st.slot);
                    }
                }
                assert!(slots_used(&steps) <= SLOTS);
            }
        }
    }

    #[test]
    fn staging_is_the_largest_piece() {
        let p = plan(&[10, 300, 20], 128, 1);
        let steps = stream_steps(&p, 0);
        assert_eq!(staging_len(&p, &steps), 128);
        let p = plan(&[10, 30, 20], 1 << 20, 2);
        assert_eq!(staging_len(&p, &stream_steps(&p, 0)), 20);
        assert_eq!(staging_len(&p, &stream_steps(&p, 1)), 30);
        // More streams than pieces: an idle stream pins nothing.
        let p = plan(&[10], 128, 4);
        let idle = stream_steps(&p, 3);
        assert!(idle.is_empty());
        assert_eq!((staging_len(&p, &idle), slots_used(&idle)), (0, 0));
        assert_eq!(slots_used(&stream_steps(&p, 0)), 1);
    }
}
