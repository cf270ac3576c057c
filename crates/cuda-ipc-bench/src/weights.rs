//! The weight set every contender of the sets section hands off: `count`
//! fp32 tensors totalling `total` bytes, their sizes drawn from a fixed
//! seed. `bench/torch_share.py` draws the same list with the same rule
//! (its `weight_set_sizes`); a test on each side pins the result, and a test
//! here compares the two lists.
//!
//! The rule: weights `w_i = 1 + (x_i >> 54)` (1 to 1024), `x_i` the
//! successive outputs of splitmix64 seeded with [`SEED`]; with
//! `U = total / 256` units, tensor `i` gets `1 + (U - count) * w_i / sum(w)`
//! units (rounded down), and the units left over (fewer than `count`) go one
//! each to the first tensors. Sizes are whole 256-byte units (the arena's
//! default alignment, so the set packs with no padding) and sum to `total`.

/// The seed of the draw.
pub const SEED: u64 = 0x13;

/// Every tensor is a whole number of these bytes.
pub const UNIT: u64 = 256;

/// One step of splitmix64: the next state and its output.
pub fn splitmix64(state: u64) -> (u64, u64) {
    let state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (state, z ^ (z >> 31))
}

/// The byte sizes of a weight set of `count` tensors totalling `total`
/// bytes: `total` a multiple of 256 with at least 256 bytes per tensor.
pub fn sizes(count: u64, total: u64) -> Result<Vec<u64>, String> {
    if count == 0 {
        return Err("a weight set has at least one tensor".into());
    }
    if total == 0 || !total.is_multiple_of(UNIT) || total / UNIT < count {
        return Err(format!(
            "{total} bytes cannot hold {count} tensors of whole {UNIT}-byte units \
             (give a total that is a multiple of {UNIT} and at least {UNIT} bytes per tensor)"
        ));
    }
    let units = total / UNIT;
    let mut state = SEED;
    let weights: Vec<u64> = (0..count)
        .map(|_| {
            let (next, x) = splitmix64(state);
            state = next;
            1 + (x >> 54)
        })
        .collect();
    let free = u128::from(units - count);
    let sum: u128 = weights.iter().map(|w| u128::from(*w)).sum();
    let mut got: Vec<u64> = weights
        .iter()
        // At most `free`: the quotient fits in u64.
        .map(|w| 1 + (free * u128::from(*w) / sum) as u64)
        .collect();
    let left = units - got.iter().sum::<u64>();
    for g in got.iter_mut().take(left as usize) {
        *g += 1;
    }
    Ok(got.into_iter().map(|u| u * UNIT).collect())
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
    fn splitmix64_reference() {
        // The first output of splitmix64 seeded with 0, as published with it.
        assert_eq!(splitmix64(0).1, 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn pinned_sizes() {
        // The same figures are pinned in bench/test_torch_share.py.
        let s = sizes(100, 4 * GIB).unwrap();
        assert_eq!(s[..4], [65_876_224, 10_484_480, 32_588_800, 7_426_816]);
        let (min, max) = (*s.iter().min().unwrap(), *s.iter().max().unwrap());
        assert_eq!(
            (min, max, checksum(&s)),
            (1_747_456, 86_756_864, 206_316_000_768)
        );
        let s = sizes(1000, 4 * GIB).unwrap();
        assert_eq!(s[..4], [6_511_360, 1_036_544, 3_221_248, 734_464]);
        let (min, max) = (*s.iter().min().unwrap(), *s.iter().max().unwrap());
        assert_eq!(
            (min, max, checksum(&s)),
            (8960, 8_825_344, 2_152_586_604_032)
        );
    }

    #[test]
    fn sizes_sum_to_the_total_in_whole_units() {
        for (count, total) in [
            (1, 256),
            (3, 768),
            (7, 1 << 20),
            (1000, 256 << 20),
            (10_000, 4 * GIB),
        ] {
            let s = sizes(count, total).unwrap();
            assert_eq!(s.len() as u64, count);
            assert_eq!(s.iter().sum::<u64>(), total);
            assert!(s.iter().all(|x| *x >= UNIT && x.is_multiple_of(UNIT)));
        }
    }

    #[test]
    fn bad_sets_say_why() {
        assert!(sizes(0, 256).unwrap_err().contains("at least one tensor"));
        for (count, total) in [(2, 256), (1, 100), (1, 0)] {
            let e = sizes(count, total).unwrap_err();
            assert!(e.contains("cannot hold"), "{e}");
        }
    }

    /// The Python side draws the same lists (skipped without python3), and
    /// its own tests pass.
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
            .arg(dir)
            .arg("-p")
            .arg("test_torch_share.py")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
