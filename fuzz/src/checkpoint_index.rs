//! The properties of fuzz target `checkpoint_index` (a sharded checkpoint's
//! `model.safetensors.index.json`, `cuda_ipc::checkpoint::ShardIndex::parse`):
//! never a panic; an index that parses names only shard paths inside its
//! directory, and written back as JSON parses to an equal index; every
//! error names the index file and says something.
//!
//! Kept apart from `lib.rs` so that the target, and the corpus replay in
//! `crates/cuda-ipc/tests/checkpoint.rs`, include this one file.

use std::path::{Component, Path};

use cuda_ipc::checkpoint::ShardIndex;

/// The checks of the index parser on arbitrary bytes; panics if a property
/// fails.
pub fn checkpoint_index(data: &[u8]) {
    let file = Path::new("dir/model.safetensors.index.json");
    match ShardIndex::parse(file, data) {
        Ok(index) => {
            assert!(!index.weight_map.is_empty());
            for (name, shard) in &index.weight_map {
                assert!(!name.is_empty());
                let path = Path::new(shard);
                assert!(
                    path.components()
                        .all(|c| matches!(c, Component::Normal(_) | Component::CurDir)),
                    "shard {shard:?} of {name:?} may leave the directory"
                );
                assert!(path.components().any(|c| matches!(c, Component::Normal(_))));
            }
            let text = serde_json::json!({
                "metadata": index.metadata,
                "weight_map": index.weight_map,
            })
            .to_string();
            let again = ShardIndex::parse(file, text.as_bytes())
                .unwrap_or_else(|e| panic!("{text} written back does not parse: {e}"));
            assert_eq!(again, index, "{text} written back parses to another index");
        }
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.contains("model.safetensors.index.json"),
                "the error {text:?} does not name the file"
            );
        }
    }
}
