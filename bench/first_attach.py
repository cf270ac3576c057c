#!/usr/bin/env python3
"""First attach in a new process, for `cuda-ipc bench`: a fresh Python
process connects to a running publisher and attaches a whole model's state
dict (`Subscriber` + `attach_state_dict`), against
`safetensors.torch.load_file(path, device="cuda:N")` of the same tensors
from the page cache, in the same run. JSON lines like bench/torch_share.py:

  {"kind": "hello", "cuda_ipc": ..., "torch": ..., "transformers": ... or null,
   "safetensors": ... or null, "device": ..., "python": ...}
  {"kind": "skip", "reason": ...}          no cuda_ipc, no torch or no CUDA
  {"kind": "note", "text": ...}            the model and where its shapes came from
  {"kind": "result", "mode": "py_first_attach", "size": BYTES, "count": KEYS,
   "warmup": W, "samples_ms": [...], "verify_failures": N,
   "parts_ms": {"connect": [...], "attach": [...], "startup": [...],
                "start_to_usable": [...], "CALL: PHASE": [...], ...}}
   (CALL: PHASE: the extension's own clock of each phase of the calls in
   FIRST_CALLS, cuda_ipc._core._last_phases)
  {"kind": "result", "mode": "safetensors_load", "size": BYTES, "count": KEYS,
   "warmup": 0, "samples_ms": [...], "verify_failures": N}
   (with "skipped": REASON and no samples where safetensors is not importable)
  {"kind": "error", "message": ...}
  {"kind": "done", "elapsed_s": ...}

The model: a Qwen2-shaped causal language model in bfloat16, about 4.4 GB
(291 state dict keys, 290 tensors: the input embedding and the output
projection are one tensor). Its shapes come from transformers' Qwen2 built
on the meta device from a `Qwen2Config` (nothing downloaded, no weights
made), or, where transformers is not importable, from the table in
`qwen2_shapes` (the same architecture; the note line says which). The
tensors are made once in the publisher's arena (cuda_ipc.torch.shareable,
which first reserves the model's size, `reserve_bytes` of its shapes on the
meta device, so the arena holds it in one chunk; `--layout` chooses
otherwise, see make_model), each filled with its own pattern of whole
numbers below 251 (exact in bfloat16), and published once
(`publish_state_dict`, no copy). A note line gives the layout and the
arena's chunks.

Method (one way, CLOCK_MONOTONIC in every process):
  py_first_attach: per sample a new Python process (the first `warmup` thrown
      away) imports cuda_ipc and torch and starts CUDA (a one-element tensor,
      synchronised), says it is ready and reads the request; the clock runs
      from just before `cuda_ipc.Subscriber(...)` to after
      `Subscriber.attach_state_dict` returned its dict of torch tensors (the
      publisher's event waited for). Parts: connect (the Subscriber), attach
      (attach_state_dict), startup (from just before the parent started the
      process to its ready line: Python, imports, CUDA) and start_to_usable
      (startup + the sample: process start to tensors usable). Then, not
      timed: every key, shape and dtype, the tied keys the same tensor
      object, and the sum of every tensor (float64, exact) checked.
  safetensors_load: the unique tensors written once to a file with
      `safetensors.torch.save_file`, read once to warm the page cache; in the
      first `loads` kept processes, after the attach is released, the clock
      runs from just before `load_file(path, device="cuda:N")` to after it
      returned and `torch.cuda.synchronize()`; the tied key is set to its
      tensor (as transformers ties them) and the same checks run.

Usage: first_attach.py --device 0 [--reps WARMUP:REPS] [--loads N]
                       [--layout reserved|filled-after|grown]
       first_attach.py --print-model     (the table's model as JSON; no torch)
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_ipc_share import Consumer, add_phases, import_on_device, last_phases  # noqa: E402
from torch_share import emit, now_ns  # noqa: E402

# A Qwen2 architecture sized to about 2.19 billion parameters: 4.37 GB in
# bfloat16 (Qwen2.5-3B's widths with 24 layers and 4 key/value heads).
QWEN2_LIKE = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "tie_word_embeddings": True,
}

# Bytes per bfloat16 element.
BF16 = 2
# Each tensor's values are whole numbers below this prime (exact in bfloat16).
PATTERN_MOD = 251
# The name the model is published under.
SET_NAME = "model"
# The extension's and the library's calls whose phases a fresh process's
# first attach keeps, as parts "CALL: PHASE" (ms; empty from a wheel
# without the clocks): `Subscriber(...)` (with the device's first open) and
# `attach_state_dict` (the set's attach, then its tensors).
FIRST_CALLS = ("subscriber", "device.open", "attach_set", "core.attach_set", "attach_state_dict")
# Elements filled per kernel when making the pattern (bounds the scratch memory).
FILL_CHUNK = 1 << 26


def qwen2_shapes(cfg=QWEN2_LIKE):
    """``(shapes, ties)`` of a Qwen2 causal LM's state dict: ``shapes`` the
    ``[(key, shape)]`` in transformers' order, ``ties`` ``{key: first key}``
    for the keys that are the same tensor as an earlier one."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    shapes = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % i
        shapes += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    shapes.append(("lm_head.weight", (cfg["vocab_size"], h)))
    ties = {"lm_head.weight": "model.embed_tokens.weight"} if cfg.get("tie_word_embeddings") else {}
    return shapes, ties


def shapes_from_transformers(torch, cfg=QWEN2_LIKE):
    """``(shapes, ties, source)`` from transformers' Qwen2 built on the meta
    device (no memory, no download); raises where transformers cannot."""
    import transformers
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**cfg))
    shapes, ties, first = [], {}, {}
    for key, t in model.state_dict(keep_vars=True).items():
        shapes.append((key, tuple(t.shape)))
        if id(t) in first:
            ties[key] = first[id(t)]
        else:
            first[id(t)] = key
    # Tied as a loaded checkpoint is, whether or not the meta model tied them.
    keys = dict(shapes)
    if cfg.get("tie_word_embeddings") and keys.get("lm_head.weight") == keys.get("model.embed_tokens.weight"):
        ties.setdefault("lm_head.weight", "model.embed_tokens.weight")
    same = "the same as" if (shapes, ties) == qwen2_shapes(cfg) else "different from"
    return shapes, ties, "transformers %s (Qwen2Config on the meta device; %s the table of first_attach.py)" % (
        transformers.__version__, same)


def model_shapes(torch):
    """The model's ``(shapes, ties, source)``: transformers' where it works,
    else the table's, saying why."""
    try:
        return shapes_from_transformers(torch)
    except Exception as e:  # not installed, or an API that moved: the table has the same shapes
        shapes, ties = qwen2_shapes()
        return shapes, ties, "the Qwen2 table of first_attach.py (transformers: %s: %s)" % (type(e).__name__, e)


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def model_summary(shapes, ties):
    """Keys, tensors, parameters and bytes (bfloat16) of a model, ties counted once."""
    params = sum(numel(s) for k, s in shapes if k not in ties)
    return {"keys": len(shapes), "tensors": len(shapes) - len(ties), "params": params, "bytes": params * BF16}


def pattern_params(k):
    """``(a, b)`` of tensor k's pattern: element j is ``((j % 251) * a + b) % 251``."""
    return 1 + k % (PATTERN_MOD - 1), (k * 37) % PATTERN_MOD


def pattern_sum(n, k):
    """The exact sum of the first ``n`` elements of tensor k's pattern. ``a``
    is never a multiple of the prime 251, so every full cycle of 251 elements
    is a permutation of 0..250."""
    a, b = pattern_params(k)
    cycles, rest = divmod(n, PATTERN_MOD)
    full = PATTERN_MOD * (PATTERN_MOD - 1) // 2
    return cycles * full + sum((m * a + b) % PATTERN_MOD for m in range(rest))


def expectations(shapes, ties):
    """``[[key, shape, sum]]`` of every key (a tied key has its tensor's)."""
    index = {}
    out = []
    for key, shape in shapes:
        k = index.setdefault(ties.get(key, key), len(index))
        out.append([key, list(shape), pattern_sum(numel(shape), k)])
    return out


def fill_pattern(torch, t, k):
    """Tensor ``t`` (contiguous) filled with tensor k's pattern."""
    a, b = pattern_params(k)
    flat = t.view(-1)
    for start in range(0, flat.numel(), FILL_CHUNK):
        n = min(FILL_CHUNK, flat.numel() - start)
        j = torch.arange(start, start + n, device=t.device, dtype=torch.int64)
        flat[start:start + n].copy_(((j % PATTERN_MOD) * a + b) % PATTERN_MOD)


def check_state_dict(torch, sd, expect, ties):
    """``None`` when ``sd`` has the keys, shapes, dtype and sums of
    ``expect`` and the ``ties`` are one tensor object, else what differs."""
    keys = [e[0] for e in expect]
    if set(sd) != set(keys):
        missing, extra = sorted(set(keys) - set(sd)), sorted(set(sd) - set(keys))
        return "keys differ: missing %s, unexpected %s" % (missing[:3], extra[:3])
    for key, shape, _ in expect:
        t = sd[key]
        if t.dtype != torch.bfloat16 or list(t.shape) != shape:
            return "%s is %s %s, expected bfloat16 %s" % (key, t.dtype, list(t.shape), shape)
    for key, first in ties.items():
        if sd[key] is not sd[first]:
            return "%s is not the same tensor as %s" % (key, first)
    sums = torch.stack([sd[key].sum(dtype=torch.float64) for key in keys]).tolist()
    for (key, _, want), got in zip(expect, sums):
        if got != want:
            return "%s sums to %s, expected %s" % (key, got, want)
    return None


def child_main(device, path):
    """One fresh process: ready, one request, one answer (JSON lines)."""
    import cuda_ipc
    import torch

    torch.cuda.set_device(device)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    print(json.dumps({"ready": True, "t_ready": now_ns()}), flush=True)
    req = json.loads(sys.stdin.readline())
    t0 = now_ns()
    sub = cuda_ipc.Subscriber(path, device=device, timeout=30)
    t_conn = now_ns()
    sd = sub.attach_state_dict(req["name"])
    t_done = now_ns()
    phases = last_phases(FIRST_CALLS)
    ans = {"t0": t0, "t_conn": t_conn, "t_done": t_done, "phases": phases,
           "bad": check_state_dict(torch, sd, req["expect"], req["ties"])}
    sd.release()
    sub.close()
    del sd
    if req.get("safetensors"):
        from safetensors.torch import load_file

        t1 = now_ns()
        loaded = load_file(req["safetensors"], device="cuda:%d" % device)
        torch.cuda.synchronize()
        ans["load_ms"] = (now_ns() - t1) / 1e6
        for key, first in req["ties"].items():
            loaded[key] = loaded[first]
        ans["load_bad"] = check_state_dict(torch, loaded, req["expect"], req["ties"])
        del loaded
    print(json.dumps(ans), flush=True)


def parse_reps(text):
    """``WARMUP:REPS`` as two integers (REPS at least 1)."""
    fields = text.split(":")
    if len(fields) != 2:
        raise ValueError("--reps is WARMUP:REPS, got %r" % text)
    warmup, reps = (int(f) for f in fields)
    if warmup < 0 or reps <= 0:
        raise ValueError("bad --reps %r" % text)
    return warmup, reps


def make_model(torch, ci, pub, shapes, ties, layout):
    """The state dict in the publisher's arena, every tensor filled,
    finished. ``layout``: ``reserved`` (the default) makes the tensors in a
    shareable block that first reserves the model's bytes
    (``cuda_ipc.torch.reserve_bytes`` of the shapes on the meta device), so
    the arena holds them in one chunk, then fills them after the block;
    ``filled-after`` the same without the reservation (the arena grows chunk
    by chunk as PyTorch asks); ``grown`` fills each tensor inside the block,
    the fill's scratch tensors coming from the arena too (the layout of the
    runs before 2026-12-02, evening)."""
    sd, made = {}, []
    reserve = None
    if layout == "reserved":
        reserve = ci.torch.reserve_bytes(
            [torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in shapes if k not in ties])
    with ci.torch.shareable(pub, reserve=reserve):
        for key, shape in shapes:
            if key in ties:
                sd[key] = sd[ties[key]]
                continue
            sd[key] = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
            if layout == "grown":
                fill_pattern(torch, sd[key], len(made))
            made.append(sd[key])
    if layout != "grown":
        for k, t in enumerate(made):
            fill_pattern(torch, t, k)
    torch.cuda.synchronize()
    return sd


def write_file(sd, ties, folder):
    """The unique tensors in a safetensors file, read back once so that it
    is in the page cache; its path."""
    from safetensors.torch import save_file

    path = os.path.join(folder, "model.safetensors")
    save_file({k: t.cpu() for k, t in sd.items() if k not in ties}, path)
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    return path


def measure(sock, device, expect, ties, warmup, reps, loads, file_path):
    """Spawns the fresh processes; ``(attach, load)``, each a dict of
    ``samples`` (ms), ``failures`` and ``parts`` (ms)."""
    attach = {"samples": [], "failures": 0,
              "parts": {"connect": [], "attach": [], "startup": [], "start_to_usable": []}}
    load = {"samples": [], "failures": 0, "parts": {}}
    for i in range(warmup + reps):
        kept = i >= warmup
        want_load = file_path if kept and len(load["samples"]) < loads else None
        c = Consumer(device, sock, script=__file__)
        try:
            ready = c.read()
            ans = c.ask({"name": SET_NAME, "expect": expect, "ties": ties, "safetensors": want_load})
        finally:
            c.close()
        for what, why in (("", ans["bad"]), (", safetensors", ans.get("load_bad"))):
            if why:
                sys.stderr.write("process %d%s: %s\n" % (i, what, why))
        if not kept:
            continue
        ms = (ans["t_done"] - ans["t0"]) / 1e6
        startup = (ready["t_ready"] - c.started_ns) / 1e6
        attach["samples"].append(ms)
        attach["failures"] += bool(ans["bad"])
        for name, v in (("connect", (ans["t_conn"] - ans["t0"]) / 1e6), ("attach", (ans["t_done"] - ans["t_conn"]) / 1e6),
                        ("startup", startup), ("start_to_usable", startup + ms)):
            attach["parts"][name].append(v)
        add_phases(attach["parts"], ans.get("phases"))
        if want_load:
            load["samples"].append(ans["load_ms"])
            load["failures"] += bool(ans.get("load_bad"))
    return attach, load


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--reps", default="1:10", help="WARMUP:REPS fresh processes (default 1:10)")
    ap.add_argument("--loads", type=int, default=5, help="safetensors loads, in the first kept processes")
    ap.add_argument("--print-model", action="store_true", help="print the table's model as JSON and exit")
    ap.add_argument("--layout", choices=("reserved", "filled-after", "grown"), default="reserved",
                    help="how the publisher lays the model out in its arena (see make_model)")
    ap.add_argument("--consumer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.consumer:
        return child_main(args.device, args.consumer)
    if args.print_model:
        shapes, ties = qwen2_shapes()
        emit(dict(model_summary(shapes, ties), ties=ties))
        return 0
    try:
        warmup, reps = parse_reps(args.reps)
        if args.loads < 0:
            raise ValueError("--loads is at least 0, not %d" % args.loads)
    except ValueError as e:
        emit({"kind": "error", "message": str(e)})
        return 2
    started = time.time()
    imported = import_on_device(args.device)
    if imported is None:
        return 0
    cuda_ipc, torch = imported
    versions = {}
    for name in ("transformers", "safetensors"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:
            versions[name] = None
    emit(dict({"kind": "hello", "cuda_ipc": cuda_ipc.__version__, "torch": torch.__version__,
               "device": torch.cuda.get_device_name(args.device), "python": sys.version.split()[0]}, **versions))
    shapes, ties, source = model_shapes(torch)
    m = model_summary(shapes, ties)
    emit({"kind": "note", "text": "first attach: a Qwen2-shaped model in bfloat16, %d keys (%d tensors, %s), "
          "%.2f GB, shapes from %s." % (m["keys"], m["tensors"], ", ".join("%s = %s" % kv for kv in ties.items())
                                        or "no tied keys", m["bytes"] / 1e9, source)})
    folder = tempfile.mkdtemp(prefix="cuda-ipc-bench-first-")
    sock = os.path.join(folder, "p.sock")
    pub = cuda_ipc.Publisher(sock, device=args.device)
    try:
        sd = make_model(torch, cuda_ipc, pub, shapes, ties, args.layout)
        pub.publish_state_dict(SET_NAME, sd)
        st = pub.arena_stats()
        emit({"kind": "note", "text": "first attach: layout %s, the arena holds %d chunks, %.2f GB" % (
            args.layout, st["chunks"], st["chunk_bytes"] / 1e9)})
        why_no_load = "safetensors is not importable" if versions["safetensors"] is None else (
            None if args.loads else "--loads 0")
        file_path = None if why_no_load else write_file(sd, ties, folder)
        attach, load = measure(sock, args.device, expectations(shapes, ties), ties, warmup, reps, args.loads,
                               file_path)
        for mode, got, w in (("py_first_attach", attach, warmup), ("safetensors_load", load, 0)):
            line = {"kind": "result", "mode": mode, "size": m["bytes"], "count": m["keys"], "warmup": w,
                    "samples_ms": got["samples"], "verify_failures": got["failures"], "parts_ms": got["parts"]}
            if mode == "safetensors_load" and why_no_load:
                line["skipped"] = why_no_load
            emit(line)
        pub.unpublish(SET_NAME, timeout=120)
    except Exception as e:
        emit({"kind": "error", "message": "%s: %s" % (type(e).__name__, e)})
        traceback.print_exc()
        return 1
    finally:
        pub.close()
        shutil.rmtree(folder, ignore_errors=True)
    emit({"kind": "done", "elapsed_s": time.time() - started})
    return 0


if __name__ == "__main__":
    sys.exit(main())
