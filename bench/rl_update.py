#!/usr/bin/env python3
"""RL weight updates on one GPU (issue 58, items 1 and 2): a trainer
process and an inference process, a Llama-shaped bfloat16 model of about
8 B parameters (random weights, nothing downloaded), and for each update
step: the trainer changes its weights, the engine sees the new version
and can generate. Every path in the same run, on the same model:

  in_place        ours: the trainer writes the service's set in place
                  (`service.Writer(in_place=True)`), the engine having
                  stepped aside (`Reader.step_aside`), which comes back at
                  the same addresses (`Reader.come_back(next=True)`).
  double_buffered ours: the trainer writes a new version
                  (`service.Writer`), the engine waits for the update,
                  attaches the new version and assigns it into its model.
  zero_copy       ours: the trainer publishes its own parameters
                  (`Publisher.publish_state_dict`, trained in place) and
                  calls `update_state_dict` per step; the engine's model
                  holds the trainer's memory.
  bucket          PyTorch's reductions as SGLang's `update_weights_from_tensor`
                  uses them: the trainer packs every parameter into one
                  flattened tensor (`torch.cat`) and puts it on a
                  `torch.multiprocessing` queue; the engine splits it back
                  and copies each piece into its own parameters.
  pinned          the naive path: the trainer copies its parameters into
                  page-locked shared host memory, the engine copies them
                  into its own parameters.

The anchor: one device copy of the same bytes (`copy_` of one flat
buffer into another), best of 5, in the trainer, same run.

Each step: the trainer changes every parameter (`mul_`, not timed); the
clock starts in the trainer when its weights are ready and stops in the
engine when the new version is usable (synchronised); CLOCK_MONOTONIC is
one clock for both processes. After a path's last step the engine
generates `--tokens` tokens greedily from a fixed prompt and the trainer
does the same with its own weights: the tokens must be identical. Peak
device memory: the device's used memory (`torch.cuda.mem_get_info`)
sampled in both processes at every step.

Then the soak: `--soak` in-place updates with the trainer's weights
changing, with both processes' device memory in use, resident host
memory, open descriptors, threads and address mappings (lines of
/proc/self/maps) read before and after.

JSON lines, then one `target` line per target with its verdict:

  {"kind": "hello", ...} / {"kind": "skip", "reason": ...}
  {"kind": "anchor", "device_copy_ms": MS, "bytes": B}
  {"kind": "result", "mode": PATH, "samples_ms": [...], "p50_ms": .., "p99_ms": ..,
   "peak_device_bytes": B, "tokens_equal": bool}
  {"kind": "soak", "updates": N, "before": {...}, "after": {...}}
  {"kind": "target", "name": ..., "measured": .., "anchor": .., "met": bool}
  {"kind": "done", "elapsed_s": S}

Usage: rl_update.py --cli PATH [--device 0] [--layers 32] [--steps 20]
                    [--paths in_place,double_buffered,zero_copy,bucket,pinned]
                    [--soak 1000] [--tokens 8]
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_share import emit, now_ns  # noqa: E402

SET = "model"
PATHS = ("in_place", "double_buffered", "zero_copy", "bucket", "pinned")
TIMEOUT_S = 600
PROMPT = [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679]


def llama_8b(layers):
    """Llama-3-8B's shape (8.0 B parameters with 32 layers), untied."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)


def on_meta(torch, cfg, device):
    """The model with its parameters on `meta` and its buffers (the rotary
    tables, outside the state dict) made on the device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        except TypeError:  # transformers before `dtype`
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    dev = "cuda:%d" % device
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent, _, child = name.rpartition(".")
            with torch.device(dev):
                fresh = type(module)(config=model.config)
            setattr(model.get_submodule(parent) if parent else model, child, fresh)
    return model.eval()


def materialised(torch, cfg, device, seed=0):
    """The model with random bf16 parameters of its own on the device."""
    model = on_meta(torch, cfg, device)
    model.to_empty(device="cuda:%d" % device)
    g = torch.Generator(device="cuda:%d" % device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    on_device_buffers(model, cfg, device)
    return model


def on_device_buffers(model, cfg, device):
    """`to_empty` leaves the rotary tables undefined: make them again."""
    import torch

    for name, module in list(model.named_modules()):
        if name.endswith("rotary_emb"):
            parent, _, child = name.rpartition(".")
            with torch.device("cuda:%d" % device):
                fresh = type(module)(config=model.config)
            setattr(model.get_submodule(parent) if parent else model, child, fresh)


def generate(torch, model, device, tokens):
    ids = torch.tensor([PROMPT], device="cuda:%d" % device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def resources(torch):
    """What a soak must leave unchanged in this process."""
    free, total = torch.cuda.mem_get_info()
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return {"device_used": total - free, "rss": rss_pages * os.sysconf("SC_PAGE_SIZE"),
            "fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "maps": maps}


def device_used(torch):
    free, total = torch.cuda.mem_get_info()
    return total - free


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def registered(torch, host):
    """Page-locks the host tensor `host` for this process's CUDA context."""
    err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError("cudaHostRegister of %d bytes failed: %s" % (host.numel(), err))


def copy_all(torch, dst, src):
    """Copies every tensor of `src` into `dst` on the current stream, in one
    call where PyTorch has it (`_foreach_copy_`: a few kernels for every
    tensor, not one launch each)."""
    with torch.no_grad():
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(dst, src)
        else:
            for d, s in zip(dst, src):
                d.copy_(s)


# --- the trainer ----------------------------------------------------------

def trainer(args, cmds, answers, down, up):
    """Owns the training weights; does what the controller says."""
    try:
        import torch

        from cuda_ipc import Publisher, service

        torch.cuda.set_device(args.device)
        cfg = llama_8b(args.layers)
        model = materialised(torch, cfg, args.device)
        params = dict(model.named_parameters())
        names = list(params)
        total = sum(p.numel() * p.element_size() for p in params.values())
        answers.put({"ready": True, "bytes": total, "tensors": len(params)})
        pub = shm = writer = None
        while True:
            cmd = cmds.get()
            op = cmd["op"]
            if op == "stop":
                break
            elif op == "anchor":
                flat = torch.empty(total, dtype=torch.uint8, device="cuda")
                other = torch.empty_like(flat)
                best = None
                for _ in range(5):
                    torch.cuda.synchronize()
                    t0 = now_ns()
                    other.copy_(flat)
                    torch.cuda.synchronize()
                    ms = (now_ns() - t0) / 1e6
                    best = ms if best is None else min(best, ms)
                del flat, other
                torch.cuda.empty_cache()
                answers.put({"device_copy_ms": best})
            elif op == "change":
                with torch.no_grad():
                    for p in params.values():
                        p.mul_(0.998)
                torch.cuda.synchronize()
                answers.put({"used": device_used(torch)})
            elif op == "create":
                with service.Writer(args.sock, SET, layout={k: p for k, p in params.items()}) as w:
                    for k, t in w.state_dict.items():
                        t.copy_(params[k])
                answers.put({"version": w.version})
            elif op in ("in_place", "double_buffered"):
                # One writer (one connection) for every step of a path, as
                # a trainer's loop keeps it.
                in_place = op == "in_place"
                if writer is None or writer.in_place != in_place:
                    if writer is not None:
                        writer.close()
                    writer = service.Writer(args.sock, SET, in_place=in_place, wait=60.0)
                t0 = now_ns()
                staging = writer.open()
                t_open = now_ns()
                copy_all(torch, [staging[k] for k in names], [params[k] for k in names])
                t_copy = now_ns()
                torch.cuda.synchronize()
                t_sync = now_ns()
                done = writer.commit()
                answers.put({"t0": t0, "version": done["version"], "used": device_used(torch),
                             "parts": {"open": t_open - t0, "copy_launch": t_copy - t_open,
                                       "copy_wait": t_sync - t_copy, "commit": now_ns() - t_sync}})
            elif op == "writer_close":
                if writer is not None:
                    writer.close()
                    writer = None
                answers.put({"closed": True})
            elif op == "publish":
                pub = Publisher(args.zsock)
                shared = pub.publish_state_dict(SET, params)
                model.load_state_dict(shared, assign=True)
                params = dict(model.named_parameters())
                torch.cuda.synchronize()
                answers.put({"published": True})
            elif op == "zero_copy":
                t0 = now_ns()
                pub.update_state_dict(SET)
                answers.put({"t0": t0, "used": device_used(torch)})
            elif op == "bucket":
                t0 = now_ns()
                bucket = torch.cat([p.detach().reshape(-1) for p in params.values()])
                torch.cuda.synchronize()
                down.put(bucket)
                used = device_used(torch)
                if up.get(timeout=TIMEOUT_S) != "done":  # the engine copied it
                    raise RuntimeError("the engine did not take the bucket")
                del bucket
                torch.cuda.ipc_collect()
                torch.cuda.empty_cache()
                answers.put({"t0": t0, "used": used})
            elif op == "pinned_setup":
                shm = torch.empty(total, dtype=torch.uint8).share_memory_()
                registered(torch, shm)
                down.put(shm)
                answers.put({"shm": True})
            elif op == "pinned":
                t0 = now_ns()
                at = 0
                for p in params.values():
                    n = p.numel() * p.element_size()
                    shm[at:at + n].copy_(p.detach().reshape(-1).view(torch.uint8), non_blocking=True)
                    at += n
                torch.cuda.synchronize()
                down.put("ready")
                answers.put({"t0": t0, "used": device_used(torch)})
            elif op == "tokens":
                answers.put({"tokens": generate(torch, model, args.device, args.tokens)})
            elif op == "resources":
                answers.put(resources(torch))
            else:
                raise RuntimeError("unknown op %r" % op)
    except Exception as e:
        answers.put({"error": "%s: %s" % (type(e).__name__, e), "trace": traceback.format_exc()})


# --- the engine -----------------------------------------------------------

def engine(args, cmds, answers, down, up):
    """The inference side: a model whose weights come by each path."""
    try:
        import torch

        from cuda_ipc import Subscriber, service

        torch.cuda.set_device(args.device)
        cfg = llama_8b(args.layers)
        model = on_meta(torch, cfg, args.device)
        reader = sd = sub = shm = None
        answers.put({"ready": True})

        def done():
            torch.cuda.synchronize()
            return {"t1": now_ns(), "used": device_used(torch)}

        def own_params():
            """Parameters of its own (the bucket and pinned paths copy in)."""
            nonlocal model
            if any(p.is_meta for p in model.parameters()):
                model = on_meta(torch, cfg, args.device)
                model.to_empty(device="cuda:%d" % args.device)
                on_device_buffers(model, cfg, args.device)
            return dict(model.named_parameters())

        while True:
            cmd = cmds.get()
            op = cmd["op"]
            if op == "stop":
                break
            elif op == "attach":
                if reader is None:
                    reader = service.Reader(args.sock, device=args.device)
                sd = reader.attach_state_dict(SET)
                model.load_state_dict(sd, assign=True)
                answers.put({"attached": True})
            elif op == "aside":
                answers.put(reader.step_aside(SET, unchecked=True))
            elif op == "in_place":
                reader.come_back(SET, next=True, timeout=TIMEOUT_S)
                answers.put(done())
            elif op == "double_buffered":
                sd.wait_update(timeout=TIMEOUT_S)
                newer = reader.attach_state_dict(SET)
                model.load_state_dict(newer, assign=True)
                old, sd = sd, newer
                try:
                    old.release()
                except Exception:
                    pass  # tensors of the old version may live a little longer
                answers.put(done())
            elif op == "detach":
                model = on_meta(torch, cfg, args.device)
                if sd is not None:
                    sd = None
                if reader is not None:
                    reader.close()
                    reader = None
                torch.cuda.empty_cache()
                answers.put({"detached": True})
            elif op == "subscribe":
                sub = Subscriber(args.zsock, device=args.device)
                sd = sub.attach_state_dict(SET)
                model.load_state_dict(sd, assign=True)
                torch.cuda.empty_cache()  # its own parameters, gone
                answers.put({"attached": True})
            elif op == "zero_copy":
                sd.wait_update(timeout=TIMEOUT_S)
                answers.put(done())
            elif op == "bucket":
                own = own_params()
                bucket = down.get(timeout=TIMEOUT_S)
                at = 0
                with torch.no_grad():
                    for p in own.values():
                        n = p.numel()
                        p.copy_(bucket[at:at + n].view(p.shape))
                        at += n
                answer = done()
                del bucket
                up.put("done")
                answers.put(answer)
            elif op == "pinned_setup":
                own_params()
                shm = down.get(timeout=TIMEOUT_S)
                registered(torch, shm)
                answers.put({"shm": True})
            elif op == "pinned":
                if down.get(timeout=TIMEOUT_S) != "ready":
                    raise RuntimeError("the trainer's copy did not come")
                at = 0
                with torch.no_grad():
                    for p in own_params().values():
                        n = p.numel() * p.element_size()
                        p.view(-1).view(torch.uint8).copy_(shm[at:at + n], non_blocking=True)
                        at += n
                answers.put(done())
            elif op == "tokens":
                answers.put({"tokens": generate(torch, model, args.device, args.tokens)})
            elif op == "resources":
                answers.put(resources(torch))
            else:
                raise RuntimeError("unknown op %r" % op)
    except Exception as e:
        answers.put({"error": "%s: %s" % (type(e).__name__, e), "trace": traceback.format_exc()})


# --- the controller -------------------------------------------------------

class Side:
    """A trainer or engine process and its queues."""

    def __init__(self, ctx, fn, args, down, up):
        self.cmds, self.answers = ctx.Queue(), ctx.Queue()
        self.p = ctx.Process(target=fn, args=(args, self.cmds, self.answers, down, up), daemon=True)
        self.p.start()
        self.ask_nothing()

    def ask_nothing(self):
        return self.wait()

    def send(self, op, **kw):
        self.cmds.put(dict(op=op, **kw))

    def wait(self):
        a = self.answers.get(timeout=TIMEOUT_S)
        if "error" in a:
            raise RuntimeError("%s\n%s" % (a["error"], a.get("trace", "")))
        return a

    def ask(self, op, **kw):
        self.send(op, **kw)
        return self.wait()


def one_update(path, tr, en):
    """One update by `path`, the engine waiting first: (ms, peak used)."""
    if path == "in_place":
        en.ask("aside")
    en.send(path)  # the engine waits for the new version from now on
    tr.send(path)
    t = tr.wait()
    e = en.wait()
    parts = {k: v / 1e6 for k, v in t.get("parts", {}).items()}
    if parts:  # what is left after the trainer's commit returned: the engine's wake
        parts["engine_after_commit"] = (e["t1"] - t["t0"]) / 1e6 - sum(parts.values())
    return (e["t1"] - t["t0"]) / 1e6, max(t["used"], e["used"]), parts


def run_path(path, args, tr, en, state):
    """`args.steps` updates by `path`; the result line (with the p50 of
    each part of an update where the path has parts)."""
    samples, peak, parts = [], 0, {}
    if path in ("in_place", "double_buffered"):
        if not state.get("created"):
            tr.ask("create")
            state["created"] = True
        en.ask("attach")
    elif path == "zero_copy":
        tr.ask("publish")
        en.ask("subscribe")
    elif path == "pinned":
        tr.ask("pinned_setup")
        en.ask("pinned_setup")
    for step in range(args.warmup + args.steps):
        peak = max(peak, tr.ask("change")["used"])
        ms, used, step_parts = one_update(path, tr, en)
        peak = max(peak, used)
        if step >= args.warmup:
            samples.append(ms)
            for k, v in step_parts.items():
                parts.setdefault(k, []).append(v)
    mine, theirs = en.ask("tokens")["tokens"], tr.ask("tokens")["tokens"]
    row = {"kind": "result", "mode": path, "samples_ms": samples, "p50_ms": pct(samples, 0.5),
           "p99_ms": pct(samples, 0.99), "peak_device_bytes": peak, "tokens": mine,
           "tokens_equal": mine == theirs, "parts_p50_ms": {k: pct(v, 0.5) for k, v in parts.items()}}
    if path in ("in_place", "double_buffered"):
        en.ask("detach")
    emit(row)
    return row


def soak(args, tr, en):
    en.ask("attach")
    before = {"trainer": tr.ask("resources"), "engine": en.ask("resources")}
    for _ in range(args.soak):
        tr.ask("change")
        one_update("in_place", tr, en)
    after = {"trainer": tr.ask("resources"), "engine": en.ask("resources")}
    en.ask("detach")
    same = all(before[s][k] == after[s][k] for s in before for k in ("fds", "threads", "maps"))
    grew = max(after[s]["device_used"] - before[s]["device_used"] for s in before)
    rss = max(after[s]["rss"] - before[s]["rss"] for s in before)
    emit({"kind": "soak", "updates": args.soak, "before": before, "after": after,
          "unchanged": same and grew <= 0 and rss <= (16 << 20)})
    return same and grew <= 0 and rss <= (16 << 20)


def target(name, measured, anchor, met):
    emit({"kind": "target", "name": name, "measured": measured, "anchor": anchor, "met": bool(met)})
    return bool(met)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cli", required=True, help="the cuda-ipc executable")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32: about 8 B parameters)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--soak", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    if any(p not in PATHS for p in paths):
        emit({"kind": "error", "message": "--paths takes %s" % ", ".join(PATHS)})
        return 2
    started = time.time()
    try:
        import torch
        import torch.multiprocessing as tmp
        import transformers

        import cuda_ipc
        from cuda_ipc import service
    except ImportError as e:
        emit({"kind": "skip", "reason": "%s is not importable" % e.name})
        return 0
    if not torch.cuda.is_available() or args.device >= torch.cuda.device_count():
        emit({"kind": "skip", "reason": "PyTorch sees no CUDA device %d" % args.device})
        return 0
    emit({"kind": "hello", "torch": torch.__version__, "transformers": transformers.__version__,
          "cuda_ipc": cuda_ipc.__version__, "device": torch.cuda.get_device_name(args.device)})
    folder = tempfile.mkdtemp(prefix="cuda-ipc-rl-")
    args.sock = os.path.join(folder, "svc.sock")
    args.zsock = os.path.join(folder, "zero.sock")
    log = open(os.path.join(folder, "service.log"), "w")
    svc = subprocess.Popen([args.cli, "serve", "--service", args.sock, "--no-keeper", "--quota", "none",
                            "--device", str(args.device)], stdin=subprocess.DEVNULL, stdout=log,
                           stderr=subprocess.STDOUT)
    ctx = tmp.get_context("spawn")
    down, up = ctx.Queue(), ctx.Queue()
    ok = True
    tr = en = None
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(args.sock):
            if svc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the service did not start")
            time.sleep(0.05)
        tr = Side(ctx, trainer, args, down, up)
        en = Side(ctx, engine, args, down, up)
        anchor = tr.ask("anchor")["device_copy_ms"]
        emit({"kind": "anchor", "device_copy_ms": anchor})
        rows, state = {}, {}
        order = [p for p in ("in_place", "double_buffered", "bucket", "pinned", "zero_copy") if p in paths]
        soaked = None
        for path in order:
            if path in ("bucket", "pinned", "zero_copy") and state.pop("created", False):
                # The service's set is not needed any more: its memory back.
                tr.ask("writer_close")
                service.drop(args.sock, SET, force=True)  # old versions the engine let go of lazily
            rows[path] = run_path(path, args, tr, en, state)
            if path == "in_place" and args.soak:
                soaked = soak(args, tr, en)
        equal = all(r["tokens_equal"] for r in rows.values())
        if "in_place" in rows:
            ip = rows["in_place"]["p50_ms"]
            target("in place <= 1.2x one device copy of the bytes", ip, anchor, ip <= 1.2 * anchor)
            if "bucket" in rows:
                b = rows["bucket"]["p50_ms"]
                target("in place >= 1.6x faster than the bucket", ip, b, b >= 1.6 * ip)
        if "zero_copy" in rows:
            z = rows["zero_copy"]["p50_ms"]
            target("zero-copy <= 0.1 ms per update", z, 0.1, z <= 0.1)
            if "bucket" in rows:
                b = rows["bucket"]["p50_ms"]
                target("zero-copy >= 100x faster than the bucket", z, b, b >= 100 * z)
        if soaked is not None:
            target("%d in-place updates, resources unchanged" % args.soak, soaked, True, soaked)
        target("the engine's tokens equal the trainer's on every path", equal, True, equal)
    except Exception as e:
        emit({"kind": "error", "message": "%s: %s" % (type(e).__name__, e), "trace": traceback.format_exc()})
        ok = False
    finally:
        for side in (en, tr):
            if side is not None:
                side.send("stop")
                side.p.join(30)
                if side.p.is_alive():
                    side.p.kill()
        svc.send_signal(signal.SIGTERM)
        try:
            svc.wait(60)
        except subprocess.TimeoutExpired:
            svc.kill()
        log.close()
    emit({"kind": "done", "elapsed_s": time.time() - started})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
