//! The properties of fuzz target `checkpoint_header` (one safetensors
//! file's header, `cuda_ipc::checkpoint::FileHeader::parse`): never a
//! panic; a header that parses is one the `safetensors` crate reads too,
//! with the same tensors; its tensors tile the data section exactly, each
//! with the bytes its type and shape take; a plan over them covers every
//! byte once; every error names the file and says something.
//!
//! Kept apart from `lib.rs` so that the target, and the corpus replay in
//! `crates/cuda-ipc/tests/checkpoint.rs`, include this one file.

use std::path::Path;

use cuda_ipc::checkpoint::{FileHeader, Plan, PlanOptions};

/// The checks of the header parser on arbitrary bytes (a whole file);
/// panics if a property fails.
pub fn checkpoint_header(data: &[u8]) {
    let file = Path::new("dir/fuzzed.safetensors");
    let header = match FileHeader::parse(file, data) {
        Ok(h) => h,
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.contains("fuzzed.safetensors"),
                "the error {text:?} does not name the file"
            );
            return;
        }
    };
    let theirs = safetensors::SafeTensors::deserialize(data)
        .unwrap_or_else(|e| panic!("parsed here, refused by safetensors: {e}"));
    assert_eq!(theirs.len(), header.tensors.len());
    let mut at = header.data_start;
    for t in &header.tensors {
        let view = theirs.tensor(&t.name).expect("a tensor safetensors lacks");
        assert_eq!(
            t.range.start, at,
            "{} does not follow its neighbour",
            t.name
        );
        assert_eq!(view.data().len() as u64, t.len());
        let elements: u64 = t.shape.iter().product();
        assert_eq!(elements * t.dtype.size(), t.len(), "{}", t.name);
        at = t.range.end;
    }
    assert_eq!(at, data.len() as u64, "bytes after the last tensor");
    let options = PlanOptions::default()
        .with_chunk_size(4096)
        .with_piece_size(100)
        .with_streams(3);
    if let Ok(plan) = Plan::new(&header.tensors, &options) {
        assert_eq!(
            plan.pieces().iter().map(|p| p.len).sum::<u64>(),
            at - header.data_start
        );
    }
}
