#!/usr/bin/env python3
"""A trainer writes versions of its weights into a weight service while a
reader follows them, checking every version by content.

    python examples/python/service_trainer.py [--steps 20] [--device 0] [--cli target/release/cuda-ipc]

It starts ``cuda-ipc serve --service`` on a socket of its own. The trainer
builds a small transformer (fixed seed, nothing downloaded) and, after
every SGD step, writes its state dict into the service with
``cuda_ipc.service.Writer`` (the first step creates the set from the
model's layout) and commits. The reader (another process) maps the set
read-only with ``cuda_ipc.service.Reader``; for each commit it waits for
the update, attaches the new version, and compares each tensor's sum with
the trainer's (float64, exact). The two go in lockstep. Then the trainer
starts a write and fails in the middle (an exception in the ``with``
block): the write is aborted and the reader still sees the last version.
Finally the service is stopped with SIGTERM and must exit 0.

Exit status 0 when every version matched; 1 with a message otherwise.
Needs PyTorch, a CUDA GPU and the ``cuda-ipc`` command: without them it
says so at once, exit status 3 (``_needs.py``).
"""

import argparse
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import traceback

import _needs  # the example next to this one

SET_NAME = "model"
D_MODEL, HEADS, FF, LAYERS, OUT = 64, 4, 128, 2, 8


def build_model(torch, device):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FF, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False),
        torch.nn.Linear(D_MODEL, OUT),
    ).to(device)


def sums(sd):
    return {k: float(t.detach().double().sum().item()) for k, t in sd.items()}


def reader(socket, device, versions, acks):
    """Follows the set: for each (version, sums) from the trainer, moves to
    that version and compares."""
    try:
        import torch
        from cuda_ipc import service

        torch.cuda.set_device(device)
        with service.Reader(socket, device=device) as r:
            sd = None
            while True:
                msg = versions.get(timeout=120)
                if msg is None:
                    break
                version, want = msg
                if sd is None:
                    sd = r.attach_state_dict(SET_NAME)
                elif version != "same":
                    # The commit's notice; the new version is attached anew.
                    sd.wait_update(timeout=30)
                    newer = r.attach_state_dict(SET_NAME)
                    sd.release()
                    sd = newer
                if not sd.read_only:
                    raise AssertionError("the reader's tensors are not read-only")
                got = sums(sd)
                bad = [k for k in want if got.get(k) != want[k]]
                acks.put(None if not bad else f"version {version}: {len(bad)} tensor(s) differ, first {bad[0]}")
            if sd is not None:
                sd.release()
        acks.put(None)
    except BaseException:
        acks.put(traceback.format_exc())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--cli", default=None)
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be at least 1")
    _needs.check("torch", gpu=True, device=args.device)
    cli = _needs.find_cli(args.cli)

    import torch
    from cuda_ipc import errors, service

    with tempfile.TemporaryDirectory() as tmp:
        socket = os.path.join(tmp, "svc.sock")
        serving = _needs.start_service(cli, socket, args.device)
        ctx = mp.get_context("spawn")
        versions, acks = ctx.Queue(), ctx.Queue()
        following = ctx.Process(target=reader, args=(socket, args.device, versions, acks))
        try:
            device = torch.device("cuda", args.device)
            model = build_model(torch, device)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            gen = torch.Generator(device=device).manual_seed(1)
            started = False
            for step in range(1, args.steps + 1):
                x = torch.randn(16, 12, D_MODEL, device=device, generator=gen)
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                state = model.state_dict()
                layout = state if step == 1 else None
                with service.Writer(socket, SET_NAME, layout=layout, device=args.device) as w:
                    for k, t in w.state_dict.items():
                        t.copy_(state[k])
                    version = w.version
                want = sums(state)
                versions.put((version, want))
                if not started:
                    following.start()
                    started = True
                bad = acks.get(timeout=120)
                if bad is not None:
                    sys.exit(f"FAILED: {bad}")
                print(f"step {step}: version {version} committed and read back")

            # A write that fails in the middle is aborted: readers keep the last version.
            try:
                with service.Writer(socket, SET_NAME, device=args.device) as w:
                    for t in w.state_dict.values():
                        t.zero_()
                    raise RuntimeError("the trainer fails in the middle of a write")
            except RuntimeError:
                pass
            rows = service.ls(socket)
            if rows[0]["state"] != "committed" or rows[0]["version"] != args.steps:
                sys.exit(f"FAILED: after an aborted write the service shows {rows}")
            versions.put(("same", want))
            bad = acks.get(timeout=120)
            if bad is not None:
                sys.exit(f"FAILED after the aborted write: {bad}")
            print("an aborted write left version", args.steps)
            versions.put(None)
            bad = acks.get(timeout=120)
            if bad is not None:
                sys.exit(f"FAILED: {bad}")
        except errors.CudaIpcError as e:
            sys.exit(f"FAILED: {type(e).__name__}: {e}")
        finally:
            if started:
                following.join(timeout=30)
            serving.send_signal(signal.SIGTERM)
            code = serving.wait(timeout=60)
        if code != 0:
            sys.exit(f"FAILED: the service exited {code}")
    print(f"OK: {args.steps} versions written, committed and read back by content")


if __name__ == "__main__":
    main()
