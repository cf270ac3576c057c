//! Tensor-parallel shard sets on one device: one service loads the whole
//! of a small Llama-shaped checkpoint and every rank's shard of it for 2
//! and 4 ranks (through 1 KiB staging buffers on 3 streams, so that the
//! row-parallel tensors are gathered several rows to a piece, or read run
//! by run where a row is wider than a piece); a reader child attaches
//! every set and checks each shard's bytes against the slices it cuts
//! from the file itself, and that the shards of each tensor put together
//! along its split dimension are the whole set's tensor. A shard the
//! world cannot split evenly is refused, naming the tensor, before
//! anything is allocated.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use cuda_ipc::checkpoint::{Checkpoint, TpRule, TpShard, shard_name};
use cuda_ipc::exchange::Subscriber;
use cuda_ipc::service::admin::LoadRequest;
use cuda_ipc::service::{Service, ServiceConfig};
use cuda_ipc::{Device, DeviceMemory, Dtype};
use safetensors::Dtype as St;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};

use super::common::{Peer, free_memory, role};
use crate::{assert_ok, test_name};

const SOCKET_ENV: &str = "CUDA_IPC_TEST_TP_SOCKET";
const DIR_ENV: &str = "CUDA_IPC_TEST_TP_CHECKPOINT";
const SET: &str = "model";
const WORLDS: [u32; 2] = [2, 4];

/// The caller's rule every shard load passes: layer 1's up_proj whole.
fn rules() -> Vec<TpRule> {
    vec![TpRule::replicate("layers.1.mlp.up_proj")]
}

/// The dimension a tensor is split along, as this test reads vLLM's
/// layers (not the library's table): column-parallel weights and biases
/// along 0, row-parallel weights along 1, the rest whole.
fn split_dim(name: &str) -> Option<usize> {
    if name.contains("layers.1.mlp.up_proj") {
        return None;
    }
    let column = ["q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj."];
    if column.iter().any(|c| name.contains(c))
        || name.starts_with("model.embed_tokens.")
        || name.starts_with("lm_head.")
    {
        return Some(0);
    }
    if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
        return Some(1);
    }
    None
}

type Spec = (String, St, Vec<usize>);

/// Llama-shaped: hidden 64, 4 heads of 16, 2 KV heads, intermediate 544
/// (a down_proj row of 1,088 bf16 bytes or 2,176 f32 bytes: wider than a
/// piece), vocabulary 128; Qwen-style q/k/v biases; layer 0 in bf16,
/// layer 1 in f32; two files and an index.
fn llama(dir: &Path) -> BTreeMap<String, (Dtype, Vec<u64>, Vec<u8>)> {
    let layer = |i: usize, dt: St| -> Vec<Spec> {
        let p = format!("model.layers.{i}");
        [
            ("input_layernorm.weight", St::F32, vec![64]),
            ("self_attn.q_proj.weight", dt, vec![64, 64]),
            ("self_attn.q_proj.bias", dt, vec![64]),
            ("self_attn.k_proj.weight", dt, vec![32, 64]),
            ("self_attn.k_proj.bias", dt, vec![32]),
            ("self_attn.v_proj.weight", dt, vec![32, 64]),
            ("self_attn.v_proj.bias", dt, vec![32]),
            ("self_attn.o_proj.weight", dt, vec![64, 64]),
            ("post_attention_layernorm.weight", St::F32, vec![64]),
            ("mlp.gate_proj.weight", dt, vec![544, 64]),
            ("mlp.up_proj.weight", dt, vec![544, 64]),
            ("mlp.down_proj.weight", dt, vec![64, 544]),
        ]
        .into_iter()
        .map(|(n, d, s)| (format!("{p}.{n}"), d, s))
        .collect()
    };
    let mut first = vec![(
        "model.embed_tokens.weight".to_string(),
        St::BF16,
        vec![128, 64],
    )];
    first.extend(layer(0, St::BF16));
    let mut second = layer(1, St::F32);
    second.push(("model.norm.weight".into(), St::F32, vec![64]));
    second.push(("lm_head.weight".into(), St::BF16, vec![128, 64]));
    let mut all = BTreeMap::new();
    let mut map = serde_json::Map::new();
    for (i, specs) in [first, second].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let data: Vec<Vec<u8>> = specs
            .iter()
            .enumerate()
            .map(|(k, (_, d, s))| {
                let len = s.iter().product::<usize>() * d.bitsize() / 8;
                let seed = (i * 64 + k) as u32;
                (0..len as u32)
                    .map(|b| (b.wrapping_mul(2_654_435_761) >> 13).wrapping_add(seed * 97) as u8)
                    .collect()
            })
            .collect();
        let views: Vec<(String, TensorView<'_>)> = specs
            .iter()
            .zip(&data)
            .map(|((n, d, s), b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        std::fs::write(
            dir.join(&file),
            safetensors::serialize(views, None).unwrap(),
        )
        .unwrap();
        for ((n, d, s), b) in specs.iter().zip(data) {
            let dtype = if *d == St::BF16 {
                Dtype::Bf16
            } else {
                Dtype::F32
            };
            all.insert(n.clone(), (dtype, s.iter().map(|&x| x as u64).collect(), b));
            map.insert(n.clone(), json!(file));
        }
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    all
}

/// Rank `rank`'s slice of `bytes` (a tensor of shape `shape`) split
/// along `dim` among `world`: of each of the `outer` rows (the dimensions
/// before `dim`), the rank's part.
fn slice(bytes: &[u8], shape: &[u64], dim: usize, rank: u64, world: u64) -> Vec<u8> {
    let outer: u64 = shape[..dim].iter().product();
    let row = bytes.len() as u64 / outer;
    let part = row / world;
    let mut out = Vec::new();
    for o in 0..outer {
        let at = (o * row + rank * part) as usize;
        out.extend_from_slice(&bytes[at..at + part as usize]);
    }
    out
}

/// The shards of one tensor put back together along `dim`.
fn concat(parts: &[Vec<u8>], outer: u64) -> Vec<u8> {
    let part = parts[0].len() as u64 / outer;
    (0..outer)
        .flat_map(|o| {
            parts.iter().flat_map(move |p| {
                p[(o * part) as usize..((o + 1) * part) as usize]
                    .iter()
                    .copied()
            })
        })
        .collect()
}

/// Every tensor of set `name` (name to dtype, shape, bytes).
fn read_set(sub: &Subscriber, name: &str) -> BTreeMap<String, (Dtype, Vec<u64>, Vec<u8>)> {
    let set = sub.attach_set(name).unwrap();
    let out = set
        .entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let bytes = set.view::<u8>(i).unwrap().to_vec().unwrap();
            (e.name.clone(), (e.dtype, e.shape.to_vec(), bytes))
        })
        .collect();
    sub.release_set(set).unwrap();
    out
}

/// The reader child: checks every set against the file and the shards
/// against the whole, and answers.
fn reader() {
    let (parent, _device, ckpt, sub) = super::service::reader_start(SOCKET_ENV, DIR_ENV);
    let answer = match check_all(&ckpt, &sub) {
        Ok((sets, bytes)) => json!({"bad": null, "sets": sets, "bytes": bytes}),
        Err(why) => json!({"bad": why}),
    };
    parent.send(&answer);
    let _ = parent.recv();
}

fn check_all(ckpt: &Checkpoint, sub: &Subscriber) -> Result<(usize, u64), String> {
    let whole = read_set(sub, SET);
    if whole.len() != ckpt.tensors().len() {
        return Err(format!("the whole set has {} tensors", whole.len()));
    }
    for t in ckpt.tensors() {
        let (dtype, shape, bytes) = &whole[&t.name];
        if (*dtype, shape) != (t.dtype, &t.shape) || *bytes != ckpt.bytes(t).unwrap() {
            return Err(format!("{}: the whole set differs from the file", t.name));
        }
    }
    let (mut sets, mut total) = (1, 0u64);
    for world in WORLDS {
        let n = u64::from(world);
        let shards: Vec<_> = (0..world)
            .map(|r| read_set(sub, &shard_name(SET, r, world).unwrap()))
            .collect();
        sets += shards.len();
        for t in ckpt.tensors() {
            let file = ckpt.bytes(t).unwrap();
            let mut parts = Vec::new();
            for (r, shard) in shards.iter().enumerate() {
                let what = format!("{} of rank {r} of {world}", t.name);
                let (dtype, shape, got) = shard.get(&t.name).ok_or(format!("no {what}"))?;
                let (want_shape, want) = match split_dim(&t.name) {
                    Some(d) => {
                        let mut s = t.shape.clone();
                        s[d] /= n;
                        (s, slice(&file, &t.shape, d, r as u64, n))
                    }
                    None => (t.shape.clone(), file.clone()),
                };
                if (*dtype, shape) != (t.dtype, &want_shape) {
                    return Err(format!("{what}: {dtype} {shape:?}, not {want_shape:?}"));
                }
                if *got != want {
                    let at = got.iter().zip(&want).position(|(a, b)| a != b);
                    return Err(format!("{what}: bytes differ (first at {at:?})"));
                }
                total += got.len() as u64;
                parts.push(got.clone());
            }
            // Put back together, the shards are the whole set's tensor.
            let together = match split_dim(&t.name) {
                Some(d) => concat(&parts, t.shape[..d].iter().product()),
                None => parts[0].clone(),
            };
            if together != whole[&t.name].2 {
                return Err(format!("{}: the {world} shards together differ", t.name));
            }
        }
    }
    Ok((sets, total))
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_parallel_shards_of_2_and_4_ranks_load_into_one_service_and_read_back() {
    if role().as_deref() == Some("reader") {
        return reader();
    }
    let dir = tempfile::tempdir().unwrap();
    let want = llama(dir.path());
    let path = dir.path().to_str().unwrap();
    let socket = dir.path().join("tp.sock");
    let device = Device::open(0).unwrap();
    let service = Service::start(&device, socket.as_path(), ServiceConfig::default()).unwrap();
    let uid = rustix::process::geteuid().as_raw();
    let request = || LoadRequest::new(SET, path).with_copies(Some(3), Some(1024));

    let whole = service.load(uid, &request()).unwrap();
    let payload: u64 = want.values().map(|t| t.2.len() as u64).sum();
    assert_eq!((whole.tensors, whole.bytes), (want.len(), payload));
    for world in WORLDS {
        let n = u64::from(world);
        for rank in 0..world {
            let shard = TpShard::new(rank, world, rules()).unwrap();
            let a = service.load(uid, &request().with_tp(Some(&shard))).unwrap();
            assert_eq!(a.set, format!("{SET}.tp{rank}-of-{world}"));
            let bytes: u64 = want
                .iter()
                .map(|(name, t)| {
                    let len = t.2.len() as u64;
                    if split_dim(name).is_some() {
                        len / n
                    } else {
                        len
                    }
                })
                .sum();
            assert_eq!((a.tensors, a.bytes), (want.len(), bytes), "{}", a.set);
        }
    }
    let held = service.stats().total_bytes;
    assert_eq!(service.ls().sets.len(), 7);

    // Three ranks cannot share a vocabulary of 128: refused, naming the
    // tensor and its file, with nothing allocated.
    let three = TpShard::new(0, 3, vec![]).unwrap();
    let free = free_memory(&device);
    let e = service
        .load(uid, &request().with_tp(Some(&three)))
        .unwrap_err();
    assert_eq!(e.code, "checkpoint", "{}", e.message);
    let message = e.message;
    assert!(
        message.contains("model.embed_tokens.weight")
            && message.contains("model-00001-of-00002.safetensors")
            && message.contains("world that divides"),
        "{message}"
    );
    assert_eq!(service.stats().total_bytes, held);
    assert_eq!(service.ls().sets.len(), 7);
    assert_eq!(free_memory(&device), free);

    let test =
        test_name!("tensor_parallel_shards_of_2_and_4_ranks_load_into_one_service_and_read_back");
    let reading = Peer::spawn_with(&test, "reader", |c| {
        c.env(SOCKET_ENV, &socket).env(DIR_ENV, dir.path());
    });
    let answer: Value = reading.recv_within(Duration::from_secs(180));
    assert_ok!(&answer, "the reader");
    assert_eq!(answer["sets"], 7);
    let shard_bytes: u64 = WORLDS
        .iter()
        .map(|&w| {
            want.iter()
                .map(|(name, t)| {
                    let len = t.2.len() as u64;
                    if split_dim(name).is_some() {
                        len
                    } else {
                        len * u64::from(w)
                    }
                })
                .sum::<u64>()
        })
        .sum();
    assert_eq!(answer["bytes"], shard_bytes);
    assert!(reading.finish(), "the reader failed");
    let report = service.shutdown(Duration::from_secs(5));
    assert_eq!(report.dropped.len(), 7);
}
