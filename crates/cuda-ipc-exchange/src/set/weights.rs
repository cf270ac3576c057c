//! The weight-set sizes every contender of the benchmark (and the CLI's set
//! mode) shares, drawn from a fixed seed.

use super::MAX_SET_ENTRIES;
use crate::error::{Error, Result};

/// The splitmix64 generator: the fixed-seed draw every contender of the
/// weight-set benchmark shares.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The byte sizes of `n` fp32 tensors totalling `total_bytes`, drawn from
/// `seed`: tensor `i` gets one fp32 element plus a share of the remaining
/// elements proportional to a weight `1 + splitmix64() % 1000` (the `i`-th
/// draw), rounded down; the last of the largest tensors takes what the
/// rounding left. Every
/// size is a multiple of 4 and they sum to `total_bytes` exactly. The same
/// `(n, total_bytes, seed)` gives the same sizes everywhere (the CLI's set
/// mode and the benchmark's weight sets use it).
///
/// # Errors
/// [`Error::InvalidArgument`] when `n` is 0 or above [`MAX_SET_ENTRIES`],
/// or `total_bytes` is not a multiple of 4 or below `4 * n`.
pub fn weight_sizes(n: usize, total_bytes: u64, seed: u64) -> Result<Vec<u64>> {
    if n == 0 || n > MAX_SET_ENTRIES {
        return Err(Error::arg(
            "tensor count",
            format!("{n} is not from 1 to {MAX_SET_ENTRIES}"),
        ));
    }
    if !total_bytes.is_multiple_of(4) || total_bytes < 4 * n as u64 {
        return Err(Error::arg(
            "total bytes",
            format!(
                "{total_bytes} is not a multiple of 4 of at least {} (one fp32 element per tensor)",
                4 * n as u64
            ),
        ));
    }
    let mut rng = SplitMix64(seed);
    let weights: Vec<u128> = (0..n)
        .map(|_| 1 + u128::from(rng.next_u64() % 1000))
        .collect();
    let sum: u128 = weights.iter().sum();
    let units = u128::from(total_bytes / 4);
    // One element each, and the rest shared in proportion to the weights.
    let rest = units - n as u128;
    let mut elems: Vec<u128> = weights.iter().map(|w| 1 + rest * w / sum).collect();
    let got: u128 = elems.iter().sum();
    let largest = elems
        .iter()
        .enumerate()
        .max_by_key(|(i, e)| (**e, *i))
        .map_or(0, |(i, _)| i);
    // Flooring loses less than one element per tensor: the largest takes them.
    elems[largest] += units - got;
    Ok(elems.into_iter().map(|e| e as u64 * 4).collect())
}

#[cfg(test)]
mod weight_tests {
    use super::*;

    #[test]
    fn weight_sizes_are_fixed_by_the_seed_and_sum_to_the_total() {
        let a = weight_sizes(1000, 4 << 30, 42).unwrap();
        assert_eq!(a, weight_sizes(1000, 4 << 30, 42).unwrap());
        assert_ne!(a, weight_sizes(1000, 4 << 30, 43).unwrap());
        assert_eq!(a.iter().sum::<u64>(), 4 << 30);
        assert!(a.iter().all(|s| *s >= 4 && s.is_multiple_of(4)));
        // The first draws of splitmix64 from 0, as published with the algorithm.
        let mut r = SplitMix64(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        for (n, total) in [(1, 4), (3, 12), (100, 400), (7, 1 << 20), (10_000, 40_000)] {
            let s = weight_sizes(n, total, 7).unwrap();
            assert_eq!(s.len(), n);
            assert_eq!(s.iter().sum::<u64>(), total, "{n} {total}");
            assert!(s.iter().all(|s| *s >= 4 && s.is_multiple_of(4)));
        }
    }

    #[test]
    fn weight_sizes_refuse_what_cannot_be_drawn() {
        for (n, total) in [(0, 4), (2, 4), (1, 6), (MAX_SET_ENTRIES + 1, 1 << 30)] {
            let e = weight_sizes(n, total, 1).unwrap_err();
            assert!(
                e.to_string().contains("tensor count") || e.to_string().contains("total bytes"),
                "{e}"
            );
        }
    }
}
