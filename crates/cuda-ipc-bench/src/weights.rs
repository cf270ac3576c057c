//! The weight set every contender of the sets section hands off: `count`
//! fp32 tensors totalling `total` bytes, their sizes drawn from a fixed
//! seed by the library's [`cuda_ipc::set::weight_sizes`] (which the CLI's
//! set mode uses too, with the same seed). `bench/torch_share.py` draws the
//! same list with the same rule (its `weight_set_sizes`); a test on each
//! side pins the result, and a test here compares the two.
//!
//! The rule: weights `w_i = 1 + x_i % 1000`, `x_i` the successive outputs of
//! splitmix64 seeded with [`SEED`]; with `E = total / 4` elements, tensor
//! `i` gets `1 + (E - count) * w_i / sum(w)` elements (rounded down), and
//! the elements the rounding left go to the largest tensor (the last of the
//! largest). Sizes are elements times 4 bytes and sum to `total` exactly.

/// The seed of the draw (the CLI's set mode uses the same).
pub const SEED: u64 = 0x5E7_5EED;

/// The byte sizes of a weight set of `count` tensors totalling `total`
/// bytes: `total` a multiple of 4 with at least 4 bytes per tensor.
pub fn sizes(count: u64, total: u64) -> Result<Vec<u64>, String> {
    let n = usize::try_from(count).map_err(|_| format!("{count} tensors is too many"))?;
    cuda_ipc::set::weight_sizes(n, total, SEED).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// Position-weighted sum, the one `bench/test_torch_share.py` pins too.
    fn checksum(s: &[u64]) -> u64 {
        s.iter().enumerate().fold(0u64, |a, (i, x)| {
            a.wrapping_add((i as u64 + 1).wrapping_mul(*x))
        })
    }

    #[test]
    fn pinned_sizes() {
        // The same figures are pinned in bench/test_torch_share.py.
        let s = sizes(100, 4 * GIB).unwrap();
        assert_eq!(s[..4], [77_560_868, 25_218_624, 68_761_564, 16_600_748]);
        let (min, max) = (*s.iter().min().unwrap(), *s.iter().max().unwrap());
        assert_eq!(
            (min, max, checksum(&s)),
            (90_716, 87_358_208, 211_502_503_036)
        );
        let s = sizes(1000, 4 * GIB).unwrap();
        assert_eq!(s[..4], [7_097_292, 2_307_660, 6_292_100, 1_519_072]);
        let (min, max) = (*s.iter().min().unwrap(), *s.iter().max().unwrap());
        assert_eq!(
            (min, max, checksum(&s)),
            (8304, 8_302_844, 2_210_082_048_708)
        );
    }

    #[test]
    fn sizes_sum_to_the_total_in_whole_units() {
        for (count, total) in [
            (1, 4),
            (3, 12),
            (100, 400),
            (7, 1 << 20),
            (1000, 256 << 20),
            (10_000, 4 * GIB),
        ] {
            let s = sizes(count, total).unwrap();
            assert_eq!(s.len() as u64, count);
            assert_eq!(s.iter().sum::<u64>(), total);
            assert!(s.iter().all(|x| *x >= 4 && x.is_multiple_of(4)));
        }
    }

    #[test]
    fn bad_sets_say_why() {
        for (count, total) in [(0, 4), (100_001, GIB)] {
            let e = sizes(count, total).unwrap_err();
            assert!(e.contains("tensor count"), "{e}");
        }
        for (count, total) in [(2, 4), (1, 6), (1, 0)] {
            let e = sizes(count, total).unwrap_err();
            assert!(e.contains("total bytes"), "{e}");
        }
    }

    /// The Python side draws the same lists (skipped without python3), and
    /// the tests of the bench's scripts pass (none needs torch or a GPU).
    #[test]
    fn python_draws_the_same_sizes() {
        let script = crate::torch::find_script(None).unwrap();
        for count in [100u64, 1000] {
            let Ok(out) = std::process::Command::new("python3")
                .arg(&script)
                .arg("--print-sizes")
                .arg(format!("{count}:{}", 4 * GIB))
                .output()
            else {
                eprintln!("skipped: no python3 here");
                return;
            };
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let theirs: Vec<u64> = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(theirs, sizes(count, 4 * GIB).unwrap(), "{count} tensors");
        }
        let dir = script.parent().unwrap();
        let out = std::process::Command::new("python3")
            .args(["-B", "-m", "unittest", "discover", "-s"])
            // the scripts the tests start write no __pycache__ either
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .arg(dir)
            .arg("-p")
            .arg("test_*.py")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
