#!/usr/bin/env python3
"""GPU check of `cuda_ipc.models`: an engine ready in one call from a
weight service's set, for each architecture family a user would bring
(small random configs, nothing downloaded): Llama, Qwen2, Qwen3, Mistral,
Gemma (tied embeddings) and a mixture of experts (Qwen3-MoE, else
Mixtral).

For each: the model is made with random bf16 weights and saved as a
safetensors checkpoint (`save_pretrained`); the reference is
`from_pretrained` of that checkpoint. A `cuda-ipc serve --service` holds
the model's weights twice: loaded from the checkpoint (`cuda-ipc load`),
and written from the reference's own state dict (`service.Writer` with
its layout: the layout a model's parameters have, which for a mixture of
experts may differ from the checkpoint's). `models.from_service` makes a
model of each in one call; its logits on a fixed input must equal the
reference's bit for bit, every parameter must be the service's memory (no
copy), and the assign must take at most 20 ms. A checkpoint whose layout
is not the model's (experts fused on load) must be refused naming the
tensors, not copied.

    python3 gpu_engines.py --cli PATH [--only llama,gemma]

Needs a CUDA GPU, torch, transformers and the cuda_ipc package; exits 77
with one sentence when one is missing. Prints what it checked and
"N passed, M failed" last.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

passed = failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        print(f"PASS  {name}", flush=True)
    else:
        failed += 1
        print(f"FAIL  {name}: {detail}", flush=True)


def configs(transformers):
    """Each family's small config, where this transformers has it."""
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    out = {}
    for name, cls, extra in [
        ("llama", "LlamaConfig", dict(tie_word_embeddings=False)),
        ("qwen2", "Qwen2Config", dict(tie_word_embeddings=False)),
        ("qwen3", "Qwen3Config", dict(tie_word_embeddings=False, head_dim=32)),
        ("mistral", "MistralConfig", dict(tie_word_embeddings=False)),
        ("gemma", "GemmaConfig", dict(head_dim=32)),  # ties its embeddings
        ("qwen3_moe", "Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                            head_dim=32, tie_word_embeddings=False)),
        ("mixtral", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    ]:
        c = getattr(transformers, cls, None)
        if c is not None:
            out[name] = c(**common, **extra)
    if "qwen3_moe" in out:
        out.pop("mixtral", None)
    return out


def logits(torch, model):
    ids = torch.arange(3, 35, device="cuda:0").reshape(2, 16) % 500
    with torch.no_grad():
        return model(ids).logits


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cli", required=True)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    try:
        import torch
        import transformers

        import cuda_ipc  # noqa: F401
        from cuda_ipc import models, service
    except ImportError as e:
        print(f"{e.name} is not importable")
        return 77
    if not torch.cuda.is_available():
        print("PyTorch sees no CUDA device")
        return 77
    from transformers import AutoModelForCausalLM

    folder = tempfile.mkdtemp(prefix="cuda-ipc-engines-")
    sock = os.path.join(folder, "svc.sock")
    log = open(os.path.join(folder, "service.log"), "w")
    svc = subprocess.Popen([args.cli, "serve", "--service", sock, "--no-keeper", "--quota", "none"],
                           stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if svc.poll() is not None or time.monotonic() > deadline:
                print("the service did not start")
                return 1
            time.sleep(0.05)
        reader = service.Reader(sock)
        only = [o for o in args.only.split(",") if o]
        for family, cfg in configs(transformers).items():
            if only and family not in only:
                continue
            d = os.path.join(folder, family)
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(d)
            ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, device_map="cuda:0").eval()
            want = logits(torch, ref)
            own = {k: t for k, t in ref.state_dict().items()}
            # Tied tensors once, as a model's layout has them.
            seen, layout = {}, {}
            for k, t in own.items():
                if t.data_ptr() not in seen:
                    seen[t.data_ptr()] = k
                    layout[k] = t
            with service.Writer(sock, family + "-own", layout=layout) as w:
                for k, t in w.state_dict.items():
                    t.copy_(layout[k])
            sources = [("own layout", family + "-own")]
            try:
                service.load(sock, d, set=family + "-ckpt")
                sources.append(("checkpoint", family + "-ckpt"))
            except cuda_ipc.CudaIpcError as e:
                check(f"{family}: the checkpoint loads into the service", False, str(e))
            for what, set_name in sources:
                name = f"{family}, {what}"
                try:
                    model = models.from_service(reader, set_name, d)
                except cuda_ipc.InvalidInput as e:
                    # A checkpoint in another layout than the model's:
                    # refused by name, never copied.
                    ok = what == "checkpoint" and "does not" in str(e)
                    check(f"{name}: refused by name (another layout)" if ok else f"{name}: built", ok, str(e))
                    continue
                got = logits(torch, model)
                check(f"{name}: logits equal from_pretrained's bit for bit", torch.equal(got, want),
                      f"max diff {(got.float() - want.float()).abs().max().item()}")
                sd = model.cuda_ipc_state_dict
                shared = {t.data_ptr() for t in sd.values()}
                ours = all(p.data_ptr() in shared for p in model.parameters())
                check(f"{name}: every parameter is the service's memory", ours)
                ready = model.cuda_ipc_ready
                check(f"{name}: ready in <= 20 ms on top of the meta build ({ready['assign_ms']:.2f} ms; "
                      f"meta {ready['meta_ms']:.1f} ms)", ready["assign_ms"] <= 20.0)
                del model, got, sd
            del ref, own, layout
            torch.cuda.empty_cache()
        reader.close()
    finally:
        svc.send_signal(signal.SIGTERM)
        try:
            svc.wait(60)
        except subprocess.TimeoutExpired:
            svc.kill()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
