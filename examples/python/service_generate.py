#!/usr/bin/env python3
"""A fresh process has a transformers model ready from a weight service,
read-only, and generates a few tokens.

    python examples/python/service_generate.py [--dir CHECKPOINT] [--tokens 8] [--device 0] [--cli target/release/cuda-ipc]

It starts ``cuda-ipc serve --service`` on a socket of its own and loads a
safetensors checkpoint into it with ``cuda_ipc.service.load`` (the loader
exits; the weights stay with the service). Without ``--dir`` it first
writes a small Qwen2-shaped model with random weights (transformers, fixed
seed, nothing downloaded). Then a new Python process:

1. builds the model from the checkpoint's ``config.json`` on the ``meta``
   device (no memory), its non-persistent buffers (the rotary embedding's
   ``inv_freq``) made again on the GPU;
2. maps the set read-only with ``cuda_ipc.service.Reader`` and hands the
   tensors to ``load_state_dict(..., assign=True)``: no copy;
3. checks every parameter against the checkpoint's bytes (``torch.equal``
   with the file's tensor) and generates ``--tokens`` tokens greedily.

It prints each part's time: building on ``meta`` apart from the attach.
Exit status 0 when every parameter matched and the tokens were made; 1
with a message otherwise. Needs PyTorch, transformers, safetensors, a CUDA
GPU and the ``cuda-ipc`` command: without them it says so at once, exit
status 3 (``_needs.py``).
"""

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import _needs  # the example next to this one

SET_NAME = "model"


def build_on_meta(torch, folder, device):
    """The model of the checkpoint in ``folder`` with its parameters on the
    meta device (no memory) and its buffers on the GPU: a buffer that is
    not in the state dict (a rotary embedding's ``inv_freq``, computed from
    the config) is made again by building its module on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    dev = "cuda:%d" % device
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        parent, _, child = name.rpartition(".")
        try:
            fresh = type(module)(config=model.config, device=dev)
        except TypeError as e:
            raise RuntimeError("module %s (%s) has buffers on the meta device and cannot be built again from the "
                               "config: %s" % (name, type(module).__name__, e)) from e
        setattr(model.get_submodule(parent) if parent else model, child, fresh)
    return model


def write_small_model(torch, folder):
    """A Qwen2-shaped bf16 model with random weights (seed 0) in ``folder``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=2048, max_position_embeddings=512,
                      tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)


def ms_since(t0):
    return (time.perf_counter_ns() - t0) / 1e6


def fresh_process(socket, folder, device, tokens):
    """The new process: the model from the service, checked, generating."""
    import torch
    from safetensors.torch import load_file

    from cuda_ipc import service

    torch.cuda.set_device(device)
    torch.zeros(1, device="cuda")
    import transformers  # noqa: F401  (its import, seconds when cold, is not timed)

    t0 = time.perf_counter_ns()
    model = build_on_meta(torch, folder, device)
    parts = {"meta": ms_since(t0)}
    t0 = time.perf_counter_ns()
    reader = service.Reader(socket, device=device, timeout=30)
    parts["connect"] = ms_since(t0)
    t1 = time.perf_counter_ns()
    sd = reader.attach_state_dict(SET_NAME)
    parts["attach"] = ms_since(t1)
    t1 = time.perf_counter_ns()
    model.load_state_dict(sd, assign=True, strict=False)
    model.tie_weights()
    parts["assign"] = ms_since(t1)
    parts["ready"] = ms_since(t0)

    # Every parameter against the file's bytes, after the timing.
    want = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        want.update(load_file(path, device="cuda:%d" % device))
    have = model.state_dict()
    bad = [k for k in want if k not in have or not torch.equal(have[k], want[k])]
    on_meta = [k for k, t in have.items() if t.is_meta]
    del want

    ids = torch.tensor([[1, 2, 3, 4]], device="cuda:%d" % device)
    with torch.inference_mode():
        t1 = time.perf_counter_ns()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        torch.cuda.synchronize()
        parts["generate"] = ms_since(t1)
    print(json.dumps({"parts_ms": parts, "read_only": bool(sd.read_only), "mismatched": bad[:5],
                      "mismatched_count": len(bad), "on_meta": on_meta[:5], "tensors": len(sd),
                      "new_tokens": out[0, ids.shape[1]:].tolist()}), flush=True)
    del model, have, sd
    reader.close()
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="a safetensors checkpoint folder with config.json (default: a small model written "
                   "here)")
    p.add_argument("--tokens", type=int, default=8, help="tokens to generate (default 8)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--cli", default=None, help="the cuda-ipc executable")
    p.add_argument("--fresh-process", nargs=2, metavar=("SOCKET", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fresh_process:
        return fresh_process(args.fresh_process[0], args.fresh_process[1], args.device, args.tokens)
    if args.tokens < 1:
        p.error("--tokens must be at least 1")
    if args.dir is not None and not os.path.exists(os.path.join(args.dir, "config.json")):
        p.error(f"{args.dir} has no config.json: pass a transformers checkpoint folder")
    _needs.check("torch", "transformers", "safetensors", gpu=True, device=args.device)
    cli = _needs.find_cli(args.cli)

    import torch

    from cuda_ipc import service

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.dir
        if folder is None:
            folder = os.path.join(tmp, "model")
            write_small_model(torch, folder)
            print("wrote a small Qwen2-shaped model to", folder)
        socket = os.path.join(tmp, "svc.sock")
        serving = _needs.start_service(cli, socket, args.device)
        try:
            loaded = service.load(socket, folder, set=SET_NAME)
            print("loaded:", loaded)
            child = subprocess.run([sys.executable, os.path.abspath(__file__), "--device", str(args.device),
                                    "--tokens", str(args.tokens), "--fresh-process", socket, folder],
                                   capture_output=True, text=True, timeout=600)
            if child.returncode != 0:
                sys.exit(f"FAILED: the fresh process exited {child.returncode}: {child.stderr.strip()[-2000:]}")
            lines = child.stdout.strip().splitlines()
            if not lines:
                sys.exit(f"FAILED: the fresh process said nothing: {child.stderr.strip()[-2000:]}")
            got = json.loads(lines[-1])
        finally:
            serving.send_signal(signal.SIGTERM)
            code = serving.wait(timeout=60)
        print("fresh process:", json.dumps(got["parts_ms"]))
        if got["mismatched_count"] or got["on_meta"]:
            sys.exit(f"FAILED: {got['mismatched_count']} parameter(s) differ from the checkpoint "
                     f"(first {got['mismatched']}); left on meta: {got['on_meta']}")
        if not got["read_only"]:
            sys.exit("FAILED: the reader's tensors are not read-only")
        if len(got["new_tokens"]) != args.tokens:
            sys.exit(f"FAILED: {len(got['new_tokens'])} tokens generated, {args.tokens} asked")
        if code != 0:
            sys.exit(f"FAILED: the service exited {code}")
    parts = got["parts_ms"]
    print(f"OK: {got['tensors']} tensors read-only from the service, every parameter equal to the checkpoint; "
          f"ready in {parts['ready']:.2f} ms (connect {parts['connect']:.2f}, attach {parts['attach']:.2f}, "
          f"assign {parts['assign']:.2f}) on top of {parts['meta']:.1f} ms on meta; tokens {got['new_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
