//! Replays a fuzz target's corpus in a plain test run: shared by the
//! integration tests that check decoders (each includes this file with
//! `#[path]`).

use std::path::{Path, PathBuf};

/// Replays every file of `fuzz/corpus/<target>` through `check` (the fuzz
/// target's properties); there must be at least five files, and at least
/// two valid inputs (`is_valid`). A file that is gone when read (a fuzzer
/// shrinking the corpus replaces files) is skipped.
pub fn replay(target: &str, check: fn(&[u8]), is_valid: fn(&[u8]) -> bool) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(
        files.len() >= 5,
        "only {} corpus files in {target}",
        files.len()
    );
    let valid = files
        .iter()
        .filter(|f| {
            let Ok(data) = std::fs::read(f) else {
                return false;
            };
            check(&data);
            is_valid(&data)
        })
        .count();
    assert!(valid >= 2, "the seeds of {target} should hold valid inputs");
}
