//! Checkpoints, without a GPU: real safetensors files and sharded
//! checkpoints written in a temporary directory (with the `safetensors`
//! crate's own `serialize`, or by hand for the damaged ones), opened,
//! checked, planned and "copied" into host buffers through the plan; every
//! refusal the reader makes; the fuzz corpora of `checkpoint_index` and
//! `checkpoint_header`, replayed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cuda_ipc::Dtype;
use cuda_ipc::checkpoint::{
    Checkpoint, FileHeader, INDEX_NAME, MAX_HEADER_BYTES, PlanOptions, SINGLE_NAME, ShardIndex,
};
use safetensors::Dtype as St;
use safetensors::tensor::TensorView;
use serde_json::json;

#[path = "support/corpus.rs"]
mod corpus;
#[path = "../../../fuzz/src/checkpoint_header.rs"]
mod fuzz_checkpoint_header;
#[path = "../../../fuzz/src/checkpoint_index.rs"]
mod fuzz_checkpoint_index;
use corpus::replay;

// ---------------------------------------------------------------------------
// Writing checkpoints

/// Bytes `0, 1, 2, ...` shifted by `seed`: every tensor's content differs.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A tensor to write: name, type, shape (in the file's elements).
type Spec = (&'static str, St, Vec<usize>);

/// Writes `specs` to `path` with safetensors' serialize; the bytes of each.
fn write(path: &Path, specs: &[Spec], seed: u8) -> BTreeMap<String, Vec<u8>> {
    let data: Vec<(String, Vec<u8>)> = specs
        .iter()
        .enumerate()
        .map(|(i, (name, dtype, shape))| {
            let bits = shape.iter().product::<usize>() * dtype.bitsize();
            (name.to_string(), pattern(bits / 8, seed + i as u8))
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = specs
        .iter()
        .zip(&data)
        .map(|((name, dtype, shape), (_, bytes))| {
            (
                name.to_string(),
                TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    let meta = Some([("format".to_string(), "pt".to_string())].into());
    std::fs::write(path, safetensors::serialize(views, meta).unwrap()).unwrap();
    data.into_iter().collect()
}

/// A file from a header written by hand and `data_len` bytes of data.
fn raw(path: &Path, header: &serde_json::Value, data_len: usize) {
    let text = header.to_string();
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.extend(pattern(data_len, 0));
    std::fs::write(path, bytes).unwrap();
}

fn index(dir: &Path, map: &[(&str, &str)]) -> PathBuf {
    let map: serde_json::Map<_, _> = map.iter().map(|(n, s)| (n.to_string(), json!(s))).collect();
    let path = dir.join(INDEX_NAME);
    std::fs::write(
        &path,
        json!({"metadata": {"total_size": 0}, "weight_map": map}).to_string(),
    )
    .unwrap();
    path
}

/// A three-shard checkpoint of mixed types; the bytes of every tensor.
fn sharded(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut all = write(
        &dir.join("model-00001-of-00003.safetensors"),
        &[
            ("model.embed_tokens.weight", St::BF16, vec![64, 32]),
            ("model.norm.weight", St::F32, vec![32]),
        ],
        1,
    );
    all.extend(write(
        &dir.join("model-00002-of-00003.safetensors"),
        &[
            ("layers.0.q.weight", St::F8_E4M3, vec![32, 32]),
            ("layers.0.q.scale", St::F32, vec![1]),
            ("layers.0.k.weight", St::I8, vec![7, 5]),
        ],
        20,
    ));
    all.extend(write(
        &dir.join("model-00003-of-00003.safetensors"),
        &[("lm_head.weight", St::F16, vec![100, 32])],
        40,
    ));
    let map: Vec<(String, String)> = [
        ("model.embed_tokens.weight", 1),
        ("model.norm.weight", 1),
        ("layers.0.q.weight", 2),
        ("layers.0.q.scale", 2),
        ("layers.0.k.weight", 2),
        ("lm_head.weight", 3),
    ]
    .iter()
    .map(|(n, s)| (n.to_string(), format!("model-0000{s}-of-00003.safetensors")))
    .collect();
    let refs: Vec<(&str, &str)> = map.iter().map(|(n, s)| (n.as_str(), s.as_str())).collect();
    index(dir, &refs);
    all
}

/// Copies the checkpoint into host "chunks" through the plan, and checks
/// every tensor's bytes there.
fn load_through_plan(ckpt: &Checkpoint, options: &PlanOptions) {
    let plan = ckpt.plan(options).unwrap();
    let mut chunks: Vec<Vec<u8>> = plan
        .chunks()
        .iter()
        .map(|c| vec![0xAA; c.len as usize])
        .collect();
    for p in plan.pieces() {
        let at = p.chunk_offset as usize;
        let dst = &mut chunks[p.chunk][at..at + p.len as usize];
        ckpt.read_into(p.file, p.file_offset, dst).unwrap();
        assert_eq!(dst, ckpt.read(p.file, p.file_offset, p.len).unwrap());
    }
    for (t, place) in ckpt.tensors().iter().zip(plan.placements()) {
        let at = place.offset as usize;
        assert_eq!(
            &chunks[place.chunk][at..at + place.len as usize],
            ckpt.bytes(t).unwrap(),
            "{}",
            t.name
        );
    }
    assert_eq!(plan.payload_bytes(), ckpt.payload_bytes());
}

fn refused(path: &Path, words: &[&str]) -> String {
    let e = Checkpoint::open(path).unwrap_err();
    assert_eq!(e.kind(), cuda_ipc::ErrorKind::InvalidInput, "{e}");
    let text = e.to_string();
    for w in words {
        assert!(text.contains(w), "{text:?} lacks {w:?}");
    }
    text
}

// ---------------------------------------------------------------------------
// What opens

#[test]
fn a_single_file_of_every_carried_type_opens_with_its_names_types_and_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    let specs: Vec<Spec> = vec![
        ("bool", St::BOOL, vec![3]),
        ("u8", St::U8, vec![2, 2]),
        ("i8", St::I8, vec![5]),
        ("u16", St::U16, vec![3]),
        ("i16", St::I16, vec![3]),
        ("u32", St::U32, vec![3]),
        ("i32", St::I32, vec![3]),
        ("u64", St::U64, vec![3]),
        ("i64", St::I64, vec![3]),
        ("f16", St::F16, vec![4, 4]),
        ("bf16", St::BF16, vec![4, 4]),
        ("f32", St::F32, vec![4, 4]),
        ("f64", St::F64, vec![2]),
        ("f8e4m3", St::F8_E4M3, vec![8]),
        ("f8e5m2", St::F8_E5M2, vec![8]),
        ("f8e4m3fnuz", St::F8_E4M3FNUZ, vec![8]),
        ("f8e5m2fnuz", St::F8_E5M2FNUZ, vec![8]),
        ("f8e8m0", St::F8_E8M0, vec![8]),
        ("f4", St::F4, vec![3, 8]),
        ("c64", St::C64, vec![2]),
        ("empty", St::F32, vec![0, 4]),
        ("scalar", St::F32, vec![]),
    ];
    let bytes = write(&path, &specs, 7);
    let ckpt = Checkpoint::open(&path).unwrap();
    assert_eq!(ckpt.tensors().len(), specs.len());
    assert!(ckpt.index().is_none());
    assert_eq!(ckpt.files()[0].metadata()["format"], "pt");
    let want = |name: &str| match name {
        "bool" => Dtype::Bool,
        "u8" => Dtype::U8,
        "i8" => Dtype::I8,
        "u16" => Dtype::U16,
        "i16" => Dtype::I16,
        "u32" => Dtype::U32,
        "i32" => Dtype::I32,
        "u64" => Dtype::U64,
        "i64" => Dtype::I64,
        "f16" => Dtype::F16,
        "bf16" => Dtype::Bf16,
        "f64" => Dtype::F64,
        "f8e4m3" => Dtype::F8E4m3fn,
        "f8e5m2" => Dtype::F8E5m2,
        "f8e4m3fnuz" => Dtype::F8E4m3fnuz,
        "f8e5m2fnuz" => Dtype::F8E5m2fnuz,
        "f8e8m0" => Dtype::F8E8m0fnu,
        "f4" => Dtype::F4E2m1fnX2,
        "c64" => Dtype::C64,
        _ => Dtype::F32,
    };
    for (name, _, shape) in &specs {
        let t = ckpt.tensor(name).unwrap();
        assert_eq!(t.dtype, want(name), "{name}");
        let mut shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        if *name == "f4" {
            shape[1] /= 2;
        }
        assert_eq!(t.shape, shape, "{name}");
        assert_eq!(ckpt.bytes(t).unwrap(), bytes[*name].as_slice(), "{name}");
    }
    // Offsets increase through the file, and the bytes tile it.
    let mut at = ckpt.files()[0].data_start();
    for t in ckpt.tensors() {
        assert_eq!(t.range.start, at);
        at = t.range.end;
    }
    assert_eq!(at, ckpt.files()[0].len());
    load_through_plan(&ckpt, &PlanOptions::default());
    load_through_plan(
        &ckpt,
        &PlanOptions::default()
            .with_chunk_size(256)
            .with_piece_size(7)
            .with_streams(3),
    );
}

#[test]
fn a_sharded_checkpoint_opens_from_its_index_and_from_its_directory() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = sharded(dir.path());
    for path in [dir.path().join(INDEX_NAME), dir.path().to_path_buf()] {
        let ckpt = Checkpoint::open(&path).unwrap();
        assert_eq!(ckpt.path(), dir.path().join(INDEX_NAME));
        assert_eq!(ckpt.files().len(), 3);
        assert_eq!(ckpt.index().unwrap().total_size, Some(0));
        let names: Vec<&str> = ckpt.tensors().iter().map(|t| t.name.as_str()).collect();
        // Shard by shard, by offset within each (serialize sorts by
        // alignment, then name).
        assert_eq!(names.len(), 6);
        assert_eq!(names.last(), Some(&"lm_head.weight"));
        for t in ckpt.tensors() {
            assert_eq!(
                ckpt.bytes(t).unwrap(),
                bytes[&t.name].as_slice(),
                "{}",
                t.name
            );
            assert!(ckpt.files()[t.file].path().starts_with(dir.path()));
        }
        assert_eq!(
            ckpt.tensor("layers.0.q.weight").unwrap().dtype,
            Dtype::F8E4m3fn
        );
        load_through_plan(
            &ckpt,
            &PlanOptions::default()
                .with_chunk_size(4096)
                .with_piece_size(1000)
                .with_streams(4),
        );
    }
}

#[test]
fn a_directory_opens_its_one_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("only.safetensors"),
        &[("a", St::F32, vec![2])],
        0,
    );
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ckpt.path(), dir.path().join("only.safetensors"));
    // model.safetensors comes first, as in transformers.
    write(&dir.path().join(SINGLE_NAME), &[("b", St::F32, vec![2])], 0);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert!(ckpt.tensor("b").is_some());
    std::fs::remove_file(dir.path().join(SINGLE_NAME)).unwrap();
    write(
        &dir.path().join("other.safetensors"),
        &[("c", St::F32, vec![2])],
        0,
    );
    refused(
        dir.path(),
        &[
            "2 *.safetensors files",
            "only.safetensors",
            "other.safetensors",
        ],
    );
    let empty = tempfile::tempdir().unwrap();
    refused(empty.path(), &["not a checkpoint directory"]);
}

#[test]
fn tensor_bytes_are_not_read_when_the_checkpoint_opens() {
    // A sparse file: a header for 1 GiB of tensor, and a hole. Opening
    // reads only the header; the data's pages stay unread (a read of the
    // hole would still give zeros, so this checks time and memory: it
    // would take seconds to read 1 GiB).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.safetensors");
    let header =
        json!({"w": {"dtype": "U8", "shape": [1u64 << 30], "data_offsets": [0, 1u64 << 30]}});
    raw(&path, &header, 0);
    let f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.set_len(std::fs::metadata(&path).unwrap().len() + (1 << 30))
        .unwrap();
    let started = std::time::Instant::now();
    let ckpt = Checkpoint::open(&path).unwrap();
    assert!(started.elapsed().as_secs_f64() < 2.0);
    assert_eq!(ckpt.payload_bytes(), 1 << 30);
    let plan = ckpt.plan(&PlanOptions::default()).unwrap();
    assert_eq!(
        plan.pieces().len() as u64,
        (1 << 30) / PlanOptions::default().piece_size
    );
}

// ---------------------------------------------------------------------------
// What is refused

#[test]
fn sharded_checkpoints_that_disagree_with_their_index_are_refused() {
    // A missing shard.
    let dir = tempfile::tempdir().unwrap();
    sharded(dir.path());
    std::fs::remove_file(dir.path().join("model-00002-of-00003.safetensors")).unwrap();
    refused(
        dir.path(),
        &[
            INDEX_NAME,
            "weight_map",
            "missing shard",
            "model-00002-of-00003.safetensors",
            "3 tensors",
        ],
    );

    // A name in two shards.
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("a.safetensors"),
        &[("x", St::F32, vec![2]), ("y", St::F32, vec![1])],
        0,
    );
    write(
        &dir.path().join("b.safetensors"),
        &[("x", St::F32, vec![2])],
        0,
    );
    index(
        dir.path(),
        &[("x", "a.safetensors"), ("y", "b.safetensors")],
    );
    refused(
        dir.path(),
        &[
            "b.safetensors",
            "tensor \"x\"",
            "two shards",
            "a.safetensors",
        ],
    );

    // A weight_map entry its shard's header lacks.
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("a.safetensors"),
        &[("x", St::F32, vec![2])],
        0,
    );
    index(
        dir.path(),
        &[("x", "a.safetensors"), ("ghost", "a.safetensors")],
    );
    refused(
        dir.path(),
        &[INDEX_NAME, "weight_map[\"ghost\"]", "no such tensor"],
    );

    // A header tensor the index maps elsewhere, or not at all.
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("a.safetensors"),
        &[("x", St::F32, vec![2])],
        0,
    );
    write(
        &dir.path().join("b.safetensors"),
        &[("y", St::F32, vec![2])],
        0,
    );
    index(
        dir.path(),
        &[("x", "b.safetensors"), ("y", "a.safetensors")],
    );
    refused(
        dir.path(),
        &[
            "a.safetensors",
            "tensor \"x\"",
            "maps it to \"b.safetensors\"",
        ],
    );
    index(
        dir.path(),
        &[("y", "b.safetensors"), ("x", "a.safetensors")],
    );
    Checkpoint::open(dir.path()).unwrap();
    index(dir.path(), &[("y", "b.safetensors")]);
    Checkpoint::open(dir.path().join("b.safetensors")).unwrap();
    let ckpt = Checkpoint::open(dir.path().join(INDEX_NAME)).unwrap();
    assert_eq!(ckpt.tensors().len(), 1);
    index(
        dir.path(),
        &[("y", "b.safetensors"), ("z", "a.safetensors")],
    );
    refused(
        dir.path(),
        &[
            "a.safetensors",
            "tensor \"x\"",
            "not in the index's weight_map",
        ],
    );
}

#[test]
fn shard_paths_that_leave_the_directory_are_refused_even_if_the_file_exists() {
    let outer = tempfile::tempdir().unwrap();
    let dir = outer.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    write(
        &outer.path().join("outside.safetensors"),
        &[("x", St::F32, vec![2])],
        0,
    );
    index(&dir, &[("x", "../outside.safetensors")]);
    refused(
        &dir,
        &[
            INDEX_NAME,
            "weight_map[\"x\"]",
            "leaves the checkpoint's directory",
        ],
    );
    let abs = outer.path().join("outside.safetensors");
    index(&dir, &[("x", abs.to_str().unwrap())]);
    refused(&dir, &["absolute path"]);
    // A directory where a shard should be is not a file.
    std::fs::create_dir(dir.join("sub.safetensors")).unwrap();
    index(&dir, &[("x", "sub.safetensors")]);
    refused(&dir, &["sub.safetensors", "not a regular file"]);
}

#[test]
fn damaged_headers_are_refused_naming_the_file_and_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.safetensors");
    let t = |dtype: &str, shape: &[u64], s: u64, e: u64| json!({"dtype": dtype, "shape": shape, "data_offsets": [s, e]});
    // Overlapping offsets.
    raw(
        &p,
        &json!({"a": t("F32", &[2], 0, 8), "b": t("F32", &[2], 4, 12)}),
        12,
    );
    refused(
        &p,
        &["bad.safetensors", "tensor \"b\"", "overlap", "\"a\" [0, 8]"],
    );
    // A gap.
    raw(
        &p,
        &json!({"a": t("F32", &[2], 0, 8), "b": t("F32", &[2], 12, 20)}),
        20,
    );
    refused(&p, &["tensor \"b\"", "4 bytes after offset 8"]);
    // Past the end of the file.
    raw(
        &p,
        &json!({"a": t("F32", &[2], 0, 8), "b": t("F32", &[2], 8, 16)}),
        12,
    );
    refused(
        &p,
        &["tensor \"b\"", "past the end of the file", "12 bytes"],
    );
    // Offsets so large that adding the header's length would overflow.
    raw(&p, &json!({"a": t("U8", &[1], 0, u64::MAX)}), 1);
    refused(&p, &["tensor \"a\"", "past the end of the file"]);
    // Bytes after the last tensor.
    raw(&p, &json!({"a": t("F32", &[2], 0, 8)}), 10);
    refused(&p, &["data", "2 bytes belong to no tensor"]);
    // Offsets that do not match the type and shape.
    raw(&p, &json!({"a": t("F32", &[3], 0, 8)}), 8);
    refused(&p, &["tensor \"a\"", "hold 8 bytes", "96 bits"]);
    // A shape that overflows.
    raw(
        &p,
        &json!({"a": t("F32", &[1u64 << 40, 1u64 << 40], 0, 8)}),
        8,
    );
    refused(&p, &["tensor \"a\"", "overflows"]);
    // A type we cannot carry, and F4 with an odd last dimension.
    raw(&p, &json!({"a": t("F6_E2M3", &[4], 0, 3)}), 3);
    refused(&p, &["tensor \"a\"", "F6_E2M3", "no counterpart"]);
    raw(&p, &json!({"a": t("F4", &[2, 3], 0, 3)}), 3);
    refused(&p, &["tensor \"a\"", "F4", "even"]);
    raw(&p, &json!({"a": t("F99", &[4], 0, 4)}), 4);
    refused(&p, &["tensor \"a\"", "F99"]);
    // Entries that are not tensor entries.
    raw(&p, &json!({"a": {"dtype": "F32", "shape": [1]}}), 4);
    refused(&p, &["tensor \"a\"", "data_offsets"]);
    raw(&p, &json!({"__metadata__": {"k": 1}}), 0);
    refused(&p, &["__metadata__.\"k\"", "not a string"]);
    raw(&p, &json!([1, 2]), 0);
    refused(&p, &["header", "not a JSON object"]);
    // The same name twice in one header.
    let text = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.push(0);
    std::fs::write(&p, &bytes).unwrap();
    refused(&p, &["header", "twice"]);
}

#[test]
fn files_that_are_not_safetensors_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.safetensors");
    std::fs::write(&p, b"short").unwrap();
    refused(&p, &["x.safetensors", "5 bytes", "not a safetensors file"]);
    std::fs::write(&p, b"").unwrap();
    refused(&p, &["0 bytes"]);
    // A header length over the limit (a text file's first 8 bytes).
    std::fs::write(&p, b"PK\x03\x04 this is a zip file, not safetensors").unwrap();
    refused(
        &p,
        &[
            "header length",
            &MAX_HEADER_BYTES.to_string(),
            "not a safetensors file",
        ],
    );
    // A header length past the end of the file.
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&p, &bytes).unwrap();
    refused(&p, &["header length", "1000 bytes", "only 2"]);
    // Not UTF-8, not JSON.
    let mut bytes = 2u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(&[0xff, 0xfe]);
    std::fs::write(&p, &bytes).unwrap();
    refused(&p, &["header", "UTF-8"]);
    let mut bytes = 2u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{[");
    std::fs::write(&p, &bytes).unwrap();
    refused(&p, &["header", "not JSON"]);
    // An index that is not one.
    let i = dir.path().join("model.safetensors.index.json");
    std::fs::write(&i, b"{\"weight\": 1}").unwrap();
    refused(&i, &["weight_map", "missing"]);
    // Nothing there.
    refused(
        &dir.path().join("nope.safetensors"),
        &["nope.safetensors", "no such file"],
    );
}

#[test]
fn a_header_parses_from_bytes_as_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.safetensors");
    write(
        &p,
        &[("w", St::BF16, vec![3, 4]), ("b", St::F32, vec![4])],
        0,
    );
    let bytes = std::fs::read(&p).unwrap();
    let header = FileHeader::parse(&p, &bytes).unwrap();
    let ckpt = Checkpoint::open(&p).unwrap();
    assert_eq!(header.tensors, ckpt.tensors());
    assert_eq!(header.data_start, ckpt.files()[0].data_start());
    let i = ShardIndex::parse(
        Path::new("i.json"),
        br#"{"weight_map": {"w": "a.safetensors"}}"#,
    )
    .unwrap();
    assert_eq!(
        i.shards().into_iter().collect::<Vec<_>>(),
        ["a.safetensors"]
    );
}

// ---------------------------------------------------------------------------
// The fuzz corpora, replayed

#[test]
fn every_index_corpus_file_passes_the_fuzz_checks() {
    replay(
        "checkpoint_index",
        fuzz_checkpoint_index::checkpoint_index,
        |d| ShardIndex::parse(Path::new("i.json"), d).is_ok(),
    );
}

#[test]
fn every_header_corpus_file_passes_the_fuzz_checks() {
    replay(
        "checkpoint_header",
        fuzz_checkpoint_header::checkpoint_header,
        |d| FileHeader::parse(Path::new("h.safetensors"), d).is_ok(),
    );
}

/// A checkpoint holding an empty tensor opens (it is a valid file), but is
/// refused for loading before anything is allocated, naming the tensor;
/// one without is publishable.
#[test]
fn an_empty_tensor_is_refused_before_loading() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write(
        &path,
        &[
            ("w", St::F32, vec![3, 4]),
            ("layers.0.empty", St::F16, vec![0, 4]),
        ],
        1,
    );
    let ckpt = Checkpoint::open(&path).unwrap();
    let e = cuda_ipc::loader::check_publishable(&ckpt).unwrap_err();
    assert_eq!(e.kind(), cuda_ipc::ErrorKind::InvalidInput, "{e}");
    let text = e.to_string();
    assert!(
        text.contains("layers.0.empty") && text.contains("no element"),
        "{text}"
    );
    write(&path, &[("w", St::F32, vec![3, 4])], 1);
    let ckpt = Checkpoint::open(&path).unwrap();
    cuda_ipc::loader::check_publishable(&ckpt).unwrap();
}
