//! Shards: names, rules, refusals, and every device byte of every rank's
//! shard traced back to its file byte (the plan's pieces applied to the
//! file positions themselves, compared with the positions an element's
//! index gives).

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::checkpoint::{Gather, Plan, PlanOptions};

fn entry(name: &str, dtype: Dtype, shape: &[u64], start: u64) -> TensorEntry {
    let len = shape.iter().product::<u64>() * dtype.size();
    TensorEntry {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        file: 0,
        range: start..start + len,
    }
}

/// Tensors laid one after another from byte 8 of file 0.
fn laid(specs: &[(&str, Dtype, &[u64])]) -> Vec<TensorEntry> {
    let mut at = 8;
    specs
        .iter()
        .map(|&(name, dtype, shape)| {
            let t = entry(name, dtype, shape, at);
            at = t.range.end;
            t
        })
        .collect()
}

#[test]
fn shard_names_are_checked() {
    assert_eq!(shard_name("model", 3, 8).unwrap(), "model.tp3-of-8");
    assert_eq!(shard_name("m", 0, 1).unwrap(), "m.tp0-of-1");
    assert_eq!(shard_name("m", 63, 64).unwrap(), "m.tp63-of-64");
    for (set, rank, world) in [
        ("m", 0, 0),
        ("m", 0, 65),
        ("m", 2, 2),
        ("m", 9, 8),
        ("", 0, 2),
    ] {
        let e = shard_name(set, rank, world).unwrap_err().to_string();
        assert!(
            e.contains("rank") || e.contains("ranks") || e.contains("empty"),
            "{e}"
        );
    }
    assert!(TpShard::new(1, 1, vec![]).is_err());
    assert!(TpShard::new(0, 2, vec![TpRule::replicate("")]).is_err());
    let many = vec![TpRule::replicate("x"); MAX_TP_RULES + 1];
    assert!(TpShard::new(0, 2, many).is_err());
    assert_eq!(
        TpShard::new(1, 4, vec![])
            .unwrap()
            .set_name("llama")
            .unwrap(),
        "llama.tp1-of-4"
    );
}

#[test]
fn rules_parse_and_print() {
    assert_eq!("mlp=1".parse::<TpRule>().unwrap(), TpRule::split("mlp", 1));
    assert_eq!(
        "norm=replicate".parse::<TpRule>().unwrap(),
        TpRule::replicate("norm")
    );
    // The last `=` separates: a pattern may hold one.
    assert_eq!("a=b=0".parse::<TpRule>().unwrap(), TpRule::split("a=b", 0));
    for rule in [TpRule::split("x.y", 2), TpRule::replicate("z")] {
        assert_eq!(rule.to_string().parse::<TpRule>().unwrap(), rule);
    }
    for bad in [
        "mlp",
        "=1",
        "mlp=",
        "mlp=-1",
        "mlp=one",
        "mlp=1.5",
        "mlp=Replicate",
    ] {
        let e = bad.parse::<TpRule>().unwrap_err().to_string();
        assert!(
            e.contains("PATTERN=DIM") || e.contains("1 to"),
            "{bad}: {e}"
        );
    }
    let long = format!("{}=0", "x".repeat(MAX_TP_PATTERN_LEN + 1));
    assert!(long.parse::<TpRule>().is_err());
}

/// The dimension a shard of 2 splits `name` along, or the refusal.
fn split(rules: Vec<TpRule>, name: &str) -> std::result::Result<Option<usize>, String> {
    TpShard::new(0, 2, rules)
        .unwrap()
        .split_of(name)
        .map(|(d, _)| d)
}

#[test]
fn the_built_in_rules_follow_vllm_for_llama_names() {
    let l = "model.layers.7";
    let want: &[(&str, Option<usize>)] = &[
        ("model.embed_tokens.weight", Some(0)),
        ("lm_head.weight", Some(0)),
        ("model.norm.weight", None),
        ("self_attn.q_proj.weight", Some(0)),
        ("self_attn.q_proj.bias", Some(0)),
        ("self_attn.k_proj.weight", Some(0)),
        ("self_attn.k_proj.bias", Some(0)),
        ("self_attn.v_proj.weight", Some(0)),
        ("self_attn.v_proj.bias", Some(0)),
        ("self_attn.o_proj.weight", Some(1)),
        ("self_attn.o_proj.bias", None),
        ("mlp.gate_proj.weight", Some(0)),
        ("mlp.up_proj.weight", Some(0)),
        ("mlp.down_proj.weight", Some(1)),
        ("mlp.down_proj.bias", None),
        ("input_layernorm.weight", None),
        ("post_attention_layernorm.weight", None),
        ("self_attn.rotary_emb.inv_freq", None),
        // Whole parts only: these are not the built-in modules.
        ("mlp.my_up_proj.weight", None),
        ("self_attn.xq_proj.weight", None),
    ];
    for &(name, dim) in want {
        let full = if name.starts_with("model.") || name.starts_with("lm_head") {
            name.to_string()
        } else {
            format!("{l}.{name}")
        };
        assert_eq!(split(vec![], &full), Ok(dim), "{full}");
    }
    // Fused projections and quantizers' tensors are refused, saying how.
    for name in [
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.self_attn.q_proj.weight_scale",
        "model.layers.0.mlp.down_proj.qweight",
    ] {
        let e = split(vec![], name).unwrap_err();
        assert!(e.contains("PATTERN=DIM"), "{name}: {e}");
    }
    // The caller's rules come first, by substring.
    let rules = vec![
        TpRule::replicate("layers.0.mlp.up_proj"),
        TpRule::split("weight_scale", 0),
        TpRule::split("norm", 0),
    ];
    assert_eq!(
        split(rules.clone(), "model.layers.0.mlp.up_proj.weight"),
        Ok(None)
    );
    assert_eq!(
        split(rules.clone(), "model.layers.1.mlp.up_proj.weight"),
        Ok(Some(0))
    );
    assert_eq!(
        split(
            rules.clone(),
            "model.layers.0.self_attn.q_proj.weight_scale"
        ),
        Ok(Some(0))
    );
    assert_eq!(split(rules, "model.norm.weight"), Ok(Some(0)));
}

/// A Llama layer's tensors (hidden 64, 4 heads of 16, 2 KV heads,
/// intermediate 96, vocabulary 40).
fn llama() -> Vec<TensorEntry> {
    laid(&[
        ("model.embed_tokens.weight", Dtype::Bf16, &[40, 64]),
        ("model.layers.0.input_layernorm.weight", Dtype::F32, &[64]),
        (
            "model.layers.0.self_attn.q_proj.weight",
            Dtype::Bf16,
            &[64, 64],
        ),
        ("model.layers.0.self_attn.q_proj.bias", Dtype::Bf16, &[64]),
        (
            "model.layers.0.self_attn.k_proj.weight",
            Dtype::Bf16,
            &[32, 64],
        ),
        (
            "model.layers.0.self_attn.v_proj.weight",
            Dtype::Bf16,
            &[32, 64],
        ),
        (
            "model.layers.0.self_attn.o_proj.weight",
            Dtype::Bf16,
            &[64, 64],
        ),
        (
            "model.layers.0.mlp.gate_proj.weight",
            Dtype::Bf16,
            &[96, 64],
        ),
        ("model.layers.0.mlp.up_proj.weight", Dtype::Bf16, &[96, 64]),
        (
            "model.layers.0.mlp.down_proj.weight",
            Dtype::Bf16,
            &[64, 96],
        ),
        ("model.norm.weight", Dtype::F32, &[64]),
        ("lm_head.weight", Dtype::Bf16, &[40, 64]),
    ])
}

#[test]
fn a_llama_layer_s_shard_shapes() {
    let ts = llama();
    let o = PlanOptions::default().with_piece_size(256).with_streams(3);
    let full = Plan::new(&ts, &o).unwrap();
    for world in [1u32, 2, 4, 8] {
        let shard = TpShard::new(world - 1, world, vec![]).unwrap();
        let plan = Plan::for_shard(&ts, &o, &shard).unwrap();
        let w = u64::from(world);
        let want: Vec<Vec<u64>> = vec![
            vec![40 / w, 64],
            vec![64],
            vec![64 / w, 64],
            vec![64 / w],
            vec![32 / w, 64],
            vec![32 / w, 64],
            vec![64, 64 / w],
            vec![96 / w, 64],
            vec![96 / w, 64],
            vec![64, 96 / w],
            vec![64],
            vec![40 / w, 64],
        ];
        assert_eq!(plan.shapes(), want, "world {world}");
        assert_eq!(plan.shard(), Some(&shard));
        // Replicated: the two norms, 256 bytes each; the rest is split.
        let replicated = 2 * 256;
        assert_eq!(
            plan.payload_bytes(),
            (full.payload_bytes() - replicated) / w + replicated
        );
        for p in plan.pieces() {
            assert!(p.len <= 256 && p.file_len() <= 256, "{p:?}");
        }
        let gathers = plan.pieces().iter().filter(|p| p.gather.is_some()).count();
        assert_eq!(gathers > 0, world > 1, "o_proj and down_proj gather rows");
    }
    assert_eq!(full.shapes()[0], [40, 64]);
    assert!(full.shard().is_none());
}

#[test]
fn refusals_name_the_tensor_and_what_to_do() {
    let shard = |world, rules| TpShard::new(0, world, rules).unwrap();
    let o = PlanOptions::default();
    // 40 rows of the vocabulary over 3 ranks.
    let e = Plan::for_shard(&llama(), &o, &shard(3, vec![]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.embed_tokens.weight"), "{e}");
    assert!(
        e.contains("embed_tokens.weight=0") && e.contains("40"),
        "{e}"
    );
    assert!(e.contains("world that divides"), "{e}");
    // A dimension the tensor lacks.
    let rules = vec![TpRule::split("input_layernorm", 1)];
    let e = Plan::for_shard(&llama(), &o, &shard(2, rules))
        .unwrap_err()
        .to_string();
    assert!(e.contains("input_layernorm.weight"), "{e}");
    assert!(
        e.contains("input_layernorm=1") && e.contains("no dimension 1"),
        "{e}"
    );
    let e = Plan::for_shard(&laid(&[("step", Dtype::I64, &[])]), &o, &{
        shard(2, vec![TpRule::split("step", 0)])
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("no dimension 0"), "{e}");
    // A packed type split inside a byte.
    let packed = laid(&[("w", Dtype::F4E2m1fnX2, &[4, 3])]);
    let e = Plan::for_shard(&packed, &o, &shard(2, vec![TpRule::split("w", 1)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("two f4 values"), "{e}");
    assert!(Plan::for_shard(&packed, &o, &shard(2, vec![TpRule::split("w", 0)])).is_ok());
    // A shape whose partial products overflow is an error, not a panic.
    let mut huge = entry("h", Dtype::F32, &[0, 1 << 40, 1 << 40], 8);
    huge.range = 8..8;
    let e = Plan::for_shard(&[huge], &o, &shard(2, vec![TpRule::split("h", 0)]));
    assert!(e.unwrap_err().to_string().contains("overflows"));
}

/// The file position each byte of a placement came from, by applying the
/// plan's pieces to the file positions; every device byte written once,
/// every read inside its tensor's range.
fn simulate(plan: &Plan, tensors: &[TensorEntry]) -> Vec<Vec<u64>> {
    let mut chunks: Vec<Vec<Option<u64>>> = plan
        .chunks()
        .iter()
        .map(|c| vec![None; c.len as usize])
        .collect();
    for p in plan.pieces() {
        let t = &tensors[p.tensor];
        assert!(p.file_offset >= t.range.start && p.file_offset + p.file_len() <= t.range.end);
        assert!(p.len >= 1 && p.len <= plan.options().piece_size, "{p:?}");
        assert!(p.file_len() <= plan.options().piece_size, "{p:?}");
        let src: Vec<u64> = (p.file_offset..p.file_offset + p.file_len()).collect();
        let got = match p.gather {
            Some(g) => {
                assert!(g.rows >= 2);
                let mut dst = vec![0; p.len as usize];
                g.apply(&src, &mut dst).unwrap();
                dst
            }
            None => src,
        };
        assert_eq!(got.len() as u64, p.len);
        for (i, pos) in got.into_iter().enumerate() {
            let slot = &mut chunks[p.chunk][p.chunk_offset as usize + i];
            assert!(slot.is_none(), "a device byte written twice");
            *slot = Some(pos);
        }
    }
    plan.placements()
        .iter()
        .map(|pl| {
            let bytes = &chunks[pl.chunk][pl.offset as usize..(pl.offset + pl.len) as usize];
            bytes
                .iter()
                .map(|b| b.expect("a device byte never written"))
                .collect()
        })
        .collect()
}

/// The file positions of rank `rank`'s shard of `t` split along `dim`
/// (`None`: the whole tensor), element by element in row-major order.
fn expected(t: &TensorEntry, dim: Option<usize>, rank: u64, world: u64) -> Vec<u64> {
    let e = t.dtype.size();
    let Some(d) = dim else {
        return t.range.clone().collect();
    };
    let part = t.shape[d] / world;
    let mut shape = t.shape.clone();
    shape[d] = part;
    let count: u64 = shape.iter().product();
    let mut out = Vec::new();
    for flat in 0..count {
        // The element's index in the shard, then in the whole tensor.
        let mut index = vec![0; shape.len()];
        let mut rest = flat;
        for k in (0..shape.len()).rev() {
            index[k] = rest % shape[k];
            rest /= shape[k];
        }
        index[d] += rank * part;
        let source = index
            .iter()
            .zip(&t.shape)
            .fold(0, |acc, (&i, &n)| acc * n + i);
        out.extend((0..e).map(|b| t.range.start + source * e + b));
    }
    out
}

/// Tensors of up to 4 dimensions, each split along a random dimension
/// divisible by the world (or replicated), in up to 2 files.
fn sharded_tensors() -> impl Strategy<Value = (u32, Vec<(TensorEntry, Option<usize>)>)> {
    prop::sample::select(vec![1u32, 2, 3, 4, 8]).prop_flat_map(|world| {
        let tensor = (
            prop::sample::select(Dtype::ALL.to_vec()),
            prop::collection::vec(1u64..5, 1..5),
            any::<prop::sample::Index>(),
            any::<bool>(),
            0usize..2,
        );
        (Just(world), prop::collection::vec(tensor, 1..8)).prop_map(|(world, specs)| {
            let mut at = [8u64, 100];
            let ts = specs
                .into_iter()
                .enumerate()
                .map(|(i, (dtype, mut shape, which, split, file))| {
                    let d = which.index(shape.len());
                    shape[d] *= u64::from(world);
                    let mut t = entry(&format!("t{i}."), dtype, &shape, at[file]);
                    t.file = file;
                    at[file] = t.range.end;
                    (t, split.then_some(d))
                })
                .collect();
            (world, ts)
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn every_shard_byte_comes_from_its_file_byte(
        (world, ts) in sharded_tensors(),
        piece in 1u64..300,
        streams in 1usize..5,
        align in 0u32..7,
    ) {
        let rules: Vec<TpRule> = ts
            .iter()
            .map(|(t, d)| TpRule { pattern: t.name.clone(), dim: *d })
            .collect();
        let tensors: Vec<TensorEntry> = ts.iter().map(|(t, _)| t.clone()).collect();
        let o = PlanOptions::default()
            .with_piece_size(piece)
            .with_streams(streams)
            .with_alignment(1 << align)
            .with_chunk_size(1 << 12);
        let mut covered: HashMap<usize, Vec<u32>> = HashMap::new();
        for rank in 0..world {
            let shard = TpShard::new(rank, world, rules.clone()).unwrap();
            let plan = Plan::for_shard(&tensors, &o, &shard).unwrap();
            let got = simulate(&plan, &tensors);
            for (i, (t, d)) in ts.iter().enumerate() {
                let want = expected(t, *d, u64::from(rank), u64::from(world));
                prop_assert_eq!(&got[i], &want, "tensor {} rank {}", i, rank);
                prop_assert_eq!(
                    plan.shapes()[i].iter().product::<u64>() * t.dtype.size(),
                    want.len() as u64
                );
                let seen = covered.entry(i).or_insert_with(|| vec![0; t.len() as usize]);
                for pos in want {
                    seen[(pos - t.range.start) as usize] += 1;
                }
            }
        }
        // The shards of a split tensor together hold each byte once; a
        // replicated one is in every shard.
        for (i, (_, d)) in ts.iter().enumerate() {
            let times = if d.is_some() { 1 } else { world };
            prop_assert!(covered[&i].iter().all(|&n| n == times), "tensor {}", i);
        }
    }
}

#[test]
fn rows_wider_than_a_piece_are_read_run_by_run() {
    // o_proj of 64x64 bf16 over 2 ranks: rows of 128 bytes, runs of 64.
    let ts = llama();
    let shard = TpShard::new(1, 2, vec![]).unwrap();
    let narrow = PlanOptions::default().with_piece_size(100);
    let plan = Plan::for_shard(&ts, &narrow, &shard).unwrap();
    let o_proj = plan.pieces().iter().filter(|p| p.tensor == 6);
    for (r, p) in o_proj.enumerate() {
        let r = r as u64;
        assert_eq!((p.len, p.gather), (64, None));
        assert_eq!(p.file_offset, ts[6].range.start + r * 128 + 64);
    }
    // A piece of 1000 bytes takes 7 whole rows (896 bytes read).
    let wide = PlanOptions::default().with_piece_size(1000);
    let plan = Plan::for_shard(&ts, &wide, &shard).unwrap();
    let first = plan.pieces().iter().find(|p| p.tensor == 6).unwrap();
    assert_eq!(
        first.gather,
        Some(Gather {
            rows: 7,
            pitch: 128
        })
    );
    assert_eq!((first.len, first.file_len()), (7 * 64, 6 * 128 + 64));
    assert_eq!(first.file_offset, ts[6].range.start + 64);
}

#[test]
fn a_gather_refuses_buffers_that_do_not_fit() {
    let g = Gather { rows: 3, pitch: 4 };
    let src: Vec<u8> = (0..10).collect();
    let mut dst = [0u8; 6];
    g.apply(&src, &mut dst).unwrap();
    assert_eq!(dst, [0, 1, 4, 5, 8, 9]);
    assert!(g.apply(&src[..9], &mut dst).is_err());
    assert!(g.apply(&src, &mut [0u8; 5]).is_err());
    assert!(g.apply(&src, &mut [0u8; 15]).is_err());
    assert!(Gather { rows: 0, pitch: 4 }.apply(&src, &mut []).is_err());
    // A pitch whose rows overflow the address space is refused, not indexed.
    let huge = Gather {
        rows: 3,
        pitch: u64::MAX / 2,
    };
    assert!(huge.apply(&src, &mut dst).is_err());
}

#[test]
fn a_checkpoint_s_refusal_names_its_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let data = vec![0u8; 3 * 2 * 4];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![3, 2], &data).unwrap();
    let bytes = safetensors::serialize([("lm_head.weight", view)], None).unwrap();
    std::fs::write(&path, bytes).unwrap();
    let ckpt = crate::checkpoint::Checkpoint::open(&path).unwrap();
    let o = PlanOptions::default();
    let e = ckpt
        .plan_shard(&o, &TpShard::new(1, 2, vec![]).unwrap())
        .unwrap_err();
    let Error::Checkpoint {
        file,
        field,
        reason,
    } = &e
    else {
        panic!("{e}");
    };
    assert_eq!((file, field.as_str()), (&path, "lm_head.weight"));
    assert!(
        reason.contains("rank 1 of 2") && reason.contains("[3, 2]"),
        "{reason}"
    );
    // Replicated by a rule, it loads whole.
    let shard = TpShard::new(1, 2, vec![TpRule::replicate("lm_head")]).unwrap();
    let plan = ckpt.plan_shard(&o, &shard).unwrap();
    assert_eq!(plan.shapes(), [vec![3, 2]]);
}
