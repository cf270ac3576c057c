//! Statistics over samples: percentiles (linear interpolation between the
//! closest ranks, as numpy's default), summaries and the least-squares slope.

use serde::{Deserialize, Serialize};

/// The value at quantile `q` (0 to 1) of `sorted` (ascending), interpolating
/// linearly between the two closest ranks; NaN for no samples.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        1 => sorted[0],
        n => {
            let pos = q.clamp(0.0, 1.0) * (n - 1) as f64;
            let lo = pos.floor() as usize;
            let hi = (lo + 1).min(n - 1);
            let frac = pos - lo as f64;
            sorted[lo] + (sorted[hi] - sorted[lo]) * frac
        }
    }
}

/// A summary of samples.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// How many samples.
    pub n: usize,
    /// The smallest.
    pub min: f64,
    /// The median.
    pub p50: f64,
    /// The 90th percentile.
    pub p90: f64,
    /// The 99th percentile (with few samples, close to the largest).
    pub p99: f64,
    /// The largest.
    pub max: f64,
    /// The arithmetic mean.
    pub mean: f64,
}

impl Stats {
    /// Summarises `samples` (any order); `None` when there are none or one
    /// is not finite.
    pub fn of(samples: &[f64]) -> Option<Stats> {
        if samples.is_empty() || samples.iter().any(|v| !v.is_finite()) {
            return None;
        }
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        Some(Stats {
            n: s.len(),
            min: s[0],
            p50: percentile(&s, 0.50),
            p90: percentile(&s, 0.90),
            p99: percentile(&s, 0.99),
            max: s[s.len() - 1],
            mean: s.iter().sum::<f64>() / s.len() as f64,
        })
    }
}

/// The least-squares slope of `y` against `x`; `None` with fewer than two
/// distinct `x`.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 2 {
        return None;
    }
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// Milliseconds between two CLOCK_MONOTONIC readings in nanoseconds
/// (negative if `end` is earlier, which would mean a clock problem).
pub fn ns_to_ms(start_ns: u64, end_ns: u64) -> f64 {
    (end_ns as f64 - start_ns as f64) / 1e6
}

/// Gigabytes per second for `bytes` moved in `ms` milliseconds.
pub fn gb_per_s(bytes: u64, ms: f64) -> f64 {
    if ms > 0.0 {
        bytes as f64 / (ms * 1e6)
    } else {
        f64::NAN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert!(close(percentile(&v, 0.0), 1.0));
        assert!(close(percentile(&v, 1.0), 100.0));
        // numpy.percentile(range(1, 101), 50) == 50.5, 90 -> 90.1, 99 -> 99.01
        assert!(close(percentile(&v, 0.5), 50.5));
        assert!(close(percentile(&v, 0.9), 90.1));
        assert!(close(percentile(&v, 0.99), 99.01));
        assert!(close(percentile(&[7.0], 0.99), 7.0));
        assert!(close(percentile(&[1.0, 3.0], 0.5), 2.0));
        assert!(percentile(&[], 0.5).is_nan());
        // out-of-range quantiles clamp
        assert!(close(percentile(&v, 2.0), 100.0));
    }

    #[test]
    fn stats_sort_and_summarise() {
        let s = Stats::of(&[5.0, 1.0, 3.0, 2.0, 4.0]).unwrap();
        assert_eq!(s.n, 5);
        assert!(close(s.min, 1.0) && close(s.max, 5.0));
        assert!(close(s.p50, 3.0));
        assert!(close(s.mean, 3.0));
        assert!(close(s.p90, 4.6));
        assert!(Stats::of(&[]).is_none());
        assert!(Stats::of(&[1.0, f64::NAN]).is_none());
    }

    #[test]
    fn slope_of_a_line() {
        let pts: Vec<(f64, f64)> = [1.0, 2.0, 4.0, 8.0]
            .iter()
            .map(|&k| (k, 0.1 + 0.02 * k))
            .collect();
        assert!(close(slope(&pts).unwrap(), 0.02));
        assert!(slope(&[(1.0, 1.0)]).is_none());
        assert!(slope(&[(2.0, 1.0), (2.0, 3.0)]).is_none());
    }

    #[test]
    fn units() {
        assert!(close(ns_to_ms(1_000_000, 3_500_000), 2.5));
        assert!(ns_to_ms(3, 1) < 0.0);
        // 2 GiB read+write of a 1 GiB copy in 0.5 ms = 4294.97 GB/s
        assert!(close(gb_per_s(2 << 30, 0.5), 2.0 * 1_073_741_824.0 / 0.5e6));
        assert!(gb_per_s(1, 0.0).is_nan());
    }
}
