//! Loading checkpoints onto a real device: a sharded checkpoint of many
//! dtypes, written with the `safetensors` crate, loaded on two streams
//! through small staging buffers (so that tensors are split into many
//! pieces and every staging buffer is refilled many times), published as a
//! set and read back by a child process, every byte compared with the
//! file; and the memory returned afterwards.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cuda_ipc::checkpoint::{Checkpoint, PlanOptions};
use cuda_ipc::exchange::{Publisher, PublisherConfig, Sharing, Subscriber, SubscriberConfig};
use cuda_ipc::loader::load_checkpoint;
use cuda_ipc::{Device, DeviceMemory, ErrorKind};
use safetensors::Dtype as St;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};

use super::common::{Parent, Peer, free_memory, role};
use crate::{assert_ok, test_name};

const SOCKET_ENV: &str = "CUDA_IPC_TEST_SOCKET";
const DIR_ENV: &str = "CUDA_IPC_TEST_CHECKPOINT";
const SET: &str = "model";

/// Bytes that differ in every tensor and every position.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

type Spec = (&'static str, St, Vec<usize>);

fn write(path: &Path, specs: &[Spec], seed: u8) -> BTreeMap<String, Vec<u8>> {
    let data: Vec<Vec<u8>> = specs
        .iter()
        .enumerate()
        .map(|(i, (_, dtype, shape))| {
            let bits = shape.iter().product::<usize>() * dtype.bitsize();
            pattern(bits / 8, seed.wrapping_add(i as u8 * 7))
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = specs
        .iter()
        .zip(&data)
        .map(|((name, dtype, shape), bytes)| {
            (
                (*name).to_string(),
                TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    let meta = Some([("format".to_string(), "pt".to_string())].into());
    std::fs::write(path, safetensors::serialize(views, meta).unwrap()).unwrap();
    specs.iter().map(|s| s.0.to_string()).zip(data).collect()
}

/// A three-shard checkpoint of many dtypes (a scalar among them) and its
/// index; the bytes of every tensor. (An empty tensor is refused before
/// loading: `tests/checkpoint.rs`.)
pub(super) fn sharded(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let shards: [(&[Spec], u8); 3] = [
        (
            &[
                ("model.embed_tokens.weight", St::BF16, vec![300, 64]),
                ("model.norm.weight", St::F32, vec![64]),
                ("model.rope.inv_freq", St::F64, vec![17]),
                ("model.step", St::I64, vec![]),
            ],
            1,
        ),
        (
            &[
                ("layers.0.q.weight", St::F8_E4M3, vec![96, 64]),
                ("layers.0.q.scale", St::F32, vec![1]),
                ("layers.0.k.weight", St::I8, vec![7, 5]),
                ("layers.0.mask", St::BOOL, vec![33]),
                ("layers.0.packed", St::U8, vec![4097]),
            ],
            60,
        ),
        (&[("lm_head.weight", St::F16, vec![250, 64])], 120),
    ];
    let mut all = BTreeMap::new();
    let mut map = serde_json::Map::new();
    for (i, (specs, seed)) in shards.iter().enumerate() {
        let file = format!("model-0000{}-of-00003.safetensors", i + 1);
        all.extend(write(&dir.join(&file), specs, *seed));
        for s in *specs {
            map.insert(s.0.to_string(), json!(file));
        }
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        json!({"metadata": {"total_size": 0}, "weight_map": map}).to_string(),
    )
    .unwrap();
    all
}

/// The child: attaches the set, compares every tensor (name, dtype,
/// shape, bytes) with the checkpoint it opens itself, and answers.
fn reader() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let socket = PathBuf::from(std::env::var(SOCKET_ENV).unwrap());
    let ckpt = Checkpoint::open(std::env::var(DIR_ENV).unwrap()).unwrap();
    let sub = Subscriber::connect(&device, socket.as_path(), SubscriberConfig::default()).unwrap();
    let set = sub.attach_set(SET).unwrap();
    let mut bad = Value::Null;
    let mut bytes = 0u64;
    for (i, e) in set.entries().iter().enumerate() {
        let Some(t) = ckpt.tensor(&e.name) else {
            bad = json!(format!("{} is not in the checkpoint", e.name));
            break;
        };
        if (t.dtype, &t.shape[..]) != (e.dtype, &e.shape[..]) {
            bad = json!(format!(
                "{}: {} {:?} vs {} {:?}",
                e.name, e.dtype, e.shape, t.dtype, t.shape
            ));
            break;
        }
        let want = ckpt.bytes(t).unwrap();
        let got: Vec<u8> = if want.is_empty() {
            Vec::new()
        } else {
            set.view::<u8>(i).unwrap().to_vec().unwrap()
        };
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b);
            bad = json!(format!(
                "{}: bytes differ (first at {at:?}, lengths {} and {})",
                e.name,
                got.len(),
                want.len()
            ));
            break;
        }
        bytes += got.len() as u64;
    }
    let tensors = set.len();
    sub.release_set(set).unwrap();
    parent.send(&json!({ "bad": bad, "tensors": tensors, "bytes": bytes }));
    let _ = parent.recv(); // until the parent closes our stdin
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_sharded_checkpoint_loads_on_two_streams_and_a_child_reads_every_byte() {
    if role().as_deref() == Some("reader") {
        return reader();
    }
    let dir = tempfile::tempdir().unwrap();
    let want = sharded(dir.path());
    let device = Device::open(0).unwrap();
    let socket = dir.path().join("p.sock");
    let publisher = Publisher::bind(&device, socket.as_path(), PublisherConfig::default()).unwrap();
    // Reserve the arena's first chunk outside the measurement.
    publisher.arena().unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    // 1000-byte pieces (not a multiple of any tensor) and 16 KiB chunks:
    // tensors split into many pieces, several chunks, staging refilled.
    let options = PlanOptions::default()
        .with_streams(2)
        .with_piece_size(1000)
        .with_chunk_size(16 << 10);
    // A first load, outside the measurement: what the driver makes for
    // this context at first use stays with the context (on 2026-12-02 the
    // H200 machines kept 2 MiB after the first load, in this build and in
    // 28ee4ca's alike). The check below is that a load gives back all it
    // took.
    let warm = load_checkpoint(&publisher, &ckpt, &options, &mut |_, _| {}).unwrap();
    drop(warm);
    publisher.trim().unwrap();
    let before = free_memory(&device);
    let mut seen: Vec<(u64, u64)> = Vec::new();
    let loaded =
        load_checkpoint(&publisher, &ckpt, &options, &mut |d, t| seen.push((d, t))).unwrap();
    let payload: u64 = want.values().map(|b| b.len() as u64).sum();
    let r = loaded.report().clone();
    assert_eq!(r.payload_bytes, payload);
    assert_eq!(r.tensors, want.len());
    assert_eq!((r.files, r.streams), (3, 2));
    assert!(r.pieces > 4 * r.tensors, "{} pieces", r.pieces);
    assert!(loaded.buffers().len() > 1, "several chunks");
    assert!(
        seen.windows(2).all(|w| w[0].0 <= w[1].0),
        "progress goes forward: {seen:?}"
    );
    assert_eq!(seen.last(), Some(&(payload, payload)));
    loaded.publish(&publisher, SET).unwrap();

    let child = Peer::spawn_with(
        &test_name!("a_sharded_checkpoint_loads_on_two_streams_and_a_child_reads_every_byte"),
        "reader",
        |c| {
            c.env(SOCKET_ENV, &socket).env(DIR_ENV, dir.path());
        },
    );
    let answer = child.recv();
    assert_ok!(&answer, "the reader");
    assert_eq!(answer["tensors"], want.len());
    assert_eq!(answer["bytes"], payload);
    assert!(child.finish(), "the reader failed");

    publisher
        .unpublish_set(SET, Some(Duration::from_secs(10)))
        .unwrap();
    // The reader's chunk mappings are leases of their own, which the
    // publisher's server ends once it has seen the reader gone: trim only
    // releases chunks nobody maps, so wait for that first.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !publisher.leases().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the reader's leases outlived it by 10 s: {:?}",
            publisher.leases()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(loaded);
    publisher.trim().unwrap();
    // The device's free memory counts every process: the driver may tear
    // the reader's context down a moment after its process exits, so give
    // it a few seconds; a chunk the publisher kept would never come back.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = free_memory(&device);
        if now == before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the load's memory did not come back in 10 s: {before} bytes free before, {now} after"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_load_into_an_isolated_publisher_is_refused_and_allocates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    sharded(dir.path());
    let device = Device::open(0).unwrap();
    let socket = dir.path().join("p.sock");
    let config = PublisherConfig::default().with_sharing(Sharing::Isolated);
    let publisher = Publisher::bind(&device, socket.as_path(), config).unwrap();
    let before = free_memory(&device);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let e =
        load_checkpoint(&publisher, &ckpt, &PlanOptions::default(), &mut |_, _| {}).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert_eq!(free_memory(&device), before);
    // Bad load options are refused the same way, before any allocation.
    let e = load_checkpoint(
        &publisher,
        &ckpt,
        &PlanOptions::default().with_streams(0),
        &mut |_, _| {},
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
}
