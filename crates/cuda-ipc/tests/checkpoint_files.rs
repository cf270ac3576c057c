//! Checkpoint files that are hostile, without a GPU: a file truncated while
//! it is read, a FIFO or a device where a checkpoint should be, headers and
//! indexes past their limits, and the [`ReadPolicy`] asked before each
//! file is read and before any header is parsed.
//!
//! Each open that could hang runs on a thread that the test waits for with
//! a deadline, so that a hang fails the test instead of stopping the run.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cuda_ipc::checkpoint::{
    Checkpoint, FileMeta, INDEX_NAME, MAX_HEADER_BYTES, MAX_HEADER_BYTES_TOTAL, MAX_INDEX_BYTES,
    MAX_SHARDS, ReadPolicy,
};
use cuda_ipc::{Error, ErrorKind};
use serde_json::json;

/// How long an open that must be refused at once may take.
const PROMPT: Duration = Duration::from_secs(5);

/// A file of `len` bytes of data (`U8` tensor `w`) after a real header.
fn single(path: &Path, len: usize) {
    let header = json!({"w": {"dtype": "U8", "shape": [len], "data_offsets": [0, len]}});
    let text = header.to_string();
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.extend((0..len).map(|i| i as u8));
    std::fs::write(path, bytes).unwrap();
}

/// A file whose first 8 bytes give a header of `n` bytes, followed by a
/// hole of `n + data` bytes (sparse: nothing is written).
fn claimed_header(path: &Path, n: u64, data: u64) {
    let f = std::fs::File::create(path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &n.to_le_bytes(), 0).unwrap();
    f.set_len(8 + n + data).unwrap();
}

/// Opens `path` on a thread; the result, or `None` if it took longer than
/// [`PROMPT`].
fn open_within(path: &Path) -> Option<Result<Checkpoint, Error>> {
    let (tx, rx) = mpsc::channel();
    let p = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(Checkpoint::open(&p));
    });
    rx.recv_timeout(PROMPT).ok()
}

fn refused_within(path: &Path, words: &[&str]) -> String {
    let started = Instant::now();
    let Some(r) = open_within(path) else {
        panic!("opening {} did not return in {PROMPT:?}", path.display());
    };
    let e = r.expect_err("refused");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    let text = e.to_string();
    for w in words {
        assert!(text.contains(w), "{text:?} lacks {w:?}");
    }
    assert!(started.elapsed() < PROMPT, "{:?}", started.elapsed());
    text
}

#[test]
fn a_file_truncated_while_it_is_open_is_an_error_naming_it_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    single(&path, 1 << 20);
    let ckpt = Checkpoint::open(&path).unwrap();
    let t = ckpt.tensor("w").unwrap().clone();
    assert_eq!(ckpt.bytes(&t).unwrap().len(), 1 << 20);
    // Another user's process truncates it while it is being loaded: a
    // reader over a map would take SIGBUS here, and the process with it.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(ckpt.files()[0].data_start() + 4096).unwrap();
    let e = ckpt.bytes(&t).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("model.safetensors") && text.contains("truncated"),
        "{text}"
    );
    let e = ckpt.read(0, t.range.start + 8192, 16).unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
    // What is still there reads.
    assert_eq!(ckpt.read(0, t.range.start, 4096).unwrap().len(), 4096);
}

#[test]
fn a_fifo_is_refused_at_once_without_being_opened() {
    let dir = tempfile::tempdir().unwrap();
    for name in [INDEX_NAME, "model.safetensors", "x.safetensors"] {
        let path = dir.path().join(name);
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &path,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let opened = open_within(&path);
        if opened.is_none() {
            // Let the blocked open go before failing.
            let _ = std::fs::OpenOptions::new().write(true).open(&path);
            panic!("opening the FIFO {name} blocked");
        }
        let text = opened.unwrap().expect_err("refused").to_string();
        assert!(text.contains("not a regular file"), "{text}");
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn a_link_to_a_device_is_refused_without_reading_it() {
    let dir = tempfile::tempdir().unwrap();
    for name in [INDEX_NAME, "model.safetensors"] {
        let path = dir.path().join(name);
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        refused_within(&path, &[name, "not a regular file"]);
        std::fs::remove_file(&path).unwrap();
    }
    // As a directory's checkpoint, and as a shard.
    std::os::unix::fs::symlink("/dev/zero", dir.path().join("model.safetensors")).unwrap();
    refused_within(dir.path(), &["not a regular file"]);
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    std::fs::write(
        dir.path().join(INDEX_NAME),
        json!({"weight_map": {"w": "zero.safetensors"}}).to_string(),
    )
    .unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.path().join("zero.safetensors")).unwrap();
    refused_within(&dir.path().join(INDEX_NAME), &["zero.safetensors"]);
}

#[test]
fn an_index_or_header_over_its_limit_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    // A header length just over the limit (sparse: nothing to read).
    let big = dir.path().join("big.safetensors");
    claimed_header(&big, MAX_HEADER_BYTES + 1, 0);
    refused_within(&big, &["header length", &MAX_HEADER_BYTES.to_string()]);
    // An index over its limit.
    let index = dir.path().join(INDEX_NAME);
    let f = std::fs::File::create(&index).unwrap();
    f.set_len(MAX_INDEX_BYTES + 1).unwrap();
    refused_within(&index, &[&MAX_INDEX_BYTES.to_string(), "index"]);
    // Shards whose headers, each within the limit, pass it together.
    let shards = MAX_HEADER_BYTES_TOTAL / MAX_HEADER_BYTES + 1;
    let map: serde_json::Map<String, serde_json::Value> = (0..shards)
        .map(|i| {
            let name = format!("s{i}.safetensors");
            claimed_header(&dir.path().join(&name), MAX_HEADER_BYTES, 0);
            (format!("t{i}"), json!(name))
        })
        .collect();
    std::fs::write(&index, json!({"weight_map": map}).to_string()).unwrap();
    refused_within(&index, &["headers", &MAX_HEADER_BYTES_TOTAL.to_string()]);
    // Too many shards.
    let map: serde_json::Map<String, serde_json::Value> = (0..=MAX_SHARDS)
        .map(|i| (format!("t{i}"), json!(format!("s{i}.safetensors"))))
        .collect();
    std::fs::write(&index, json!({"weight_map": map}).to_string()).unwrap();
    refused_within(&index, &["shard files", &MAX_SHARDS.to_string()]);
}

/// A policy that records what it was asked and refuses what it is told.
#[derive(Default)]
struct Recorder {
    asked: Mutex<Vec<String>>,
    refuse_file: Option<String>,
    max_bytes: Option<u64>,
}

impl ReadPolicy for Recorder {
    fn may_read(&self, path: &Path, meta: &FileMeta) -> cuda_ipc::Result<()> {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        self.asked.lock().unwrap().push(format!("read {name}"));
        assert_eq!(
            meta.uid,
            std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(path).unwrap())
        );
        if self.refuse_file.as_deref() == Some(name.as_str()) {
            return Err(Error::InvalidArgument {
                what: "policy",
                reason: format!("may not read {name}"),
            });
        }
        Ok(())
    }

    fn may_load(&self, bytes: u64) -> cuda_ipc::Result<()> {
        self.asked.lock().unwrap().push(format!("load {bytes}"));
        match self.max_bytes {
            Some(max) if bytes > max => Err(Error::InvalidArgument {
                what: "policy",
                reason: format!("{bytes} bytes"),
            }),
            _ => Ok(()),
        }
    }
}

/// A sharded checkpoint: `a` (16 bytes) in a.safetensors, `b` (a header
/// that is not JSON, 32 bytes of data) in b.safetensors.
fn two_shards(dir: &Path) -> PathBuf {
    single(&dir.join("a.safetensors"), 16);
    let mut bad = 6u64.to_le_bytes().to_vec();
    bad.extend_from_slice(b"{nope!");
    bad.extend_from_slice(&[0; 32]);
    std::fs::write(dir.join("b.safetensors"), bad).unwrap();
    let index = dir.join(INDEX_NAME);
    std::fs::write(
        &index,
        json!({"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}).to_string(),
    )
    .unwrap();
    index
}

#[test]
fn the_policy_decides_on_each_file_before_it_is_read_and_on_the_size_before_any_header() {
    let dir = tempfile::tempdir().unwrap();
    let index = two_shards(dir.path());
    // Every file asked about, in order, then the size: 16 + 32 bytes of
    // data. Only then is a header read (b's is damaged).
    let all = Recorder::default();
    let e = Checkpoint::open_with(&index, &all).unwrap_err();
    assert!(e.to_string().contains("b.safetensors"), "{e}");
    assert_eq!(
        *all.asked.lock().unwrap(),
        [
            "read model.safetensors.index.json",
            "read a.safetensors",
            "read b.safetensors",
            "load 48"
        ]
    );
    // A refused shard: its damaged header is never read, nor said anything of.
    let no_b = Recorder {
        refuse_file: Some("b.safetensors".into()),
        ..Recorder::default()
    };
    let text = Checkpoint::open_with(&index, &no_b)
        .unwrap_err()
        .to_string();
    assert!(text.contains("may not read b.safetensors"), "{text}");
    assert!(!text.contains("JSON"), "{text}");
    // Too large: refused before any header is parsed.
    let small = Recorder {
        max_bytes: Some(47),
        ..Recorder::default()
    };
    let text = Checkpoint::open_with(&index, &small)
        .unwrap_err()
        .to_string();
    assert!(text.contains("48 bytes"), "{text}");
    // A refused index: nothing else is opened.
    let no_index = Recorder {
        refuse_file: Some(INDEX_NAME.into()),
        ..Recorder::default()
    };
    assert!(Checkpoint::open_with(&index, &no_index).is_err());
    assert_eq!(no_index.asked.lock().unwrap().len(), 1);
    // A directory is asked about before it is searched.
    let no_dir = Recorder {
        refuse_file: Some(dir.path().file_name().unwrap().to_string_lossy().into()),
        ..Recorder::default()
    };
    assert!(Checkpoint::open_with(dir.path(), &no_dir).is_err());
    assert_eq!(no_dir.asked.lock().unwrap().len(), 1);
}
