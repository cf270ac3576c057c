#!/usr/bin/env python3
"""Weight sync between a trainer and an inference process, without copies.

    python examples/python/weight_sync.py [--steps 100] [--device 0]

The trainer builds a small transformer (torch.nn.TransformerEncoder and a
linear head, fixed seed, nothing downloaded), publishes its state dict as a
set (copied once into the publisher's arena) and then trains *in* the shared
tensors: ``model.load_state_dict(shared, assign=True)``. After every SGD step
on random data it calls ``update_state_dict``: no copy, one message.

The inference process attaches the state dict (zero-copy views of the
trainer's memory), loads it into its own model the same way, and for each
update runs a forward pass on a fixed input. It checks the output against a
local copy of the model trained identically (same seed, same data) up to the
same step. The two processes go in lockstep: the trainer waits until the
inference process has checked a step before it writes the next one.

Exit status 0 when every step matched (``atol`` 1e-4); 1 with a message
otherwise. Needs PyTorch and a CUDA GPU: without them it says so at once,
exit status 3 (``_needs.py``).
"""

import argparse
import gc
import os
import queue
import sys
import tempfile
import time
import traceback
import warnings

import _needs  # the example next to this one

# Deterministic cuBLAS (set before CUDA starts, in every process).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

SET_NAME = "model"
D_MODEL, HEADS, FF, LAYERS, OUT = 64, 4, 128, 2, 8
BATCH, SEQ = 16, 12
LR = 0.01
ATOL = 1e-4


def build_model(torch, seed, device):
    """The same transformer for every process that passes the same seed."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FF, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False),
        torch.nn.Linear(D_MODEL, OUT),
    )
    return model.to(device)


def batch(torch, step, device):
    """Step `step`'s training data: the same in every process."""
    g = torch.Generator(device=device)
    g.manual_seed(1000 + step)
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=g, device=device)
    y = torch.randn(BATCH, SEQ, OUT, generator=g, device=device)
    return x, y


def train_step(torch, model, opt, step, device):
    x, y = batch(torch, step, device)
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return float(loss)


def fixed_input(torch, device):
    g = torch.Generator(device=device)
    g.manual_seed(7)
    return torch.randn(4, SEQ, D_MODEL, generator=g, device=device)


def setup_torch(torch):
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def trainer(socket, steps, device_index, ready, acks):
    import torch

    import cuda_ipc

    setup_torch(torch)
    device = torch.device("cuda", device_index)
    model = build_model(torch, 0, device)
    with cuda_ipc.Publisher(socket, device=device_index) as pub:
        # The one copy, into the publisher's arena; from here on the model
        # trains in the shared tensors (so the copy warning does not apply).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shared = pub.publish_state_dict(SET_NAME, model.state_dict())
        model.load_state_dict(shared, assign=True)
        del shared
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        ready.put(("ready", pub.arena_mechanism))
        expect_ack(acks, 0)
        loss = None
        for step in range(1, steps + 1):
            loss = train_step(torch, model, opt, step, device)
            pub.update_state_dict(SET_NAME)  # waits for the step's kernels, then one message
            expect_ack(acks, step)
        # The subscriber releases once it has checked the last step.
        pub.unpublish(SET_NAME, timeout=60)
    return loss


def expect_ack(acks, step, timeout=120):
    try:
        got = acks.get(timeout=timeout)
    except queue.Empty:
        raise RuntimeError(f"the inference process did not check step {step} within {timeout} s") from None
    if got != step:
        raise RuntimeError(f"the inference process says {got!r}, expected step {step}")


def inference(socket, steps, device_index, ready, acks, results):
    import torch

    import cuda_ipc

    setup_torch(torch)
    device = torch.device("cuda", device_index)
    what, _ = ready.get(timeout=300)
    if what != "ready":
        raise RuntimeError(f"the trainer says {what!r}")
    # The reference: trained here exactly as the trainer trains.
    reference = build_model(torch, 0, device)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    x = fixed_input(torch, device)
    worst = 0.0
    with cuda_ipc.Subscriber(socket, device=device_index, timeout=30) as sub:
        sd = sub.attach_state_dict(SET_NAME)
        model = build_model(torch, 1, device)  # other weights, replaced by the shared ones
        model.load_state_dict(sd, assign=True)
        model.eval()
        ptrs = {t.data_ptr() for t in sd.values()}
        if any(p.data_ptr() not in ptrs for p in model.parameters()):
            raise RuntimeError("the model's parameters are not the attached tensors")
        for step in range(steps + 1):
            if step:
                sd.wait_update(timeout=120)
                reference.train()
                train_step(torch, reference, ref_opt, step, device)
            reference.eval()
            with torch.no_grad():
                got, want = model(x), reference(x)
            diff = float((got - want).abs().max())
            worst = max(worst, diff)
            if not torch.allclose(got, want, rtol=0, atol=ATOL):
                raise RuntimeError(f"step {step}: the output differs from the local reference by {diff:.3g} "
                                   f"(atol {ATOL})")
            acks.put(step)
        # The model's parameters are views of the set: drop them, then release.
        del model
        gc.collect()
        sd.release()
    results.put(worst)


def run_role(role, *args):
    """A child's body: exit status 1 with the error on stderr."""
    try:
        (trainer if role == "trainer" else inference)(*args)
    except BaseException:
        sys.stderr.write(f"weight_sync {role}: {traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    ap.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    _needs.check("torch", gpu=True, device=args.device)
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, acks, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    socket = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-weight-sync-"), "trainer.sock")
    t0 = time.perf_counter()
    procs = {
        "trainer": ctx.Process(target=run_role, args=("trainer", socket, args.steps, args.device, ready, acks)),
        "inference": ctx.Process(target=run_role,
                                 args=("inference", socket, args.steps, args.device, ready, acks, results)),
    }
    for p in procs.values():
        p.start()
    failed = []
    deadline = time.time() + 60 + 3 * args.steps
    for name, p in procs.items():
        p.join(max(1.0, deadline - time.time()))
        if p.is_alive():
            failed.append(f"the {name} process did not finish in time")
        elif p.exitcode != 0:
            failed.append(f"the {name} process exited {p.exitcode}")
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join(10)
    if failed:
        # Once one side fails the other times out waiting for it: name both.
        print(f"weight_sync: FAILED: {'; '.join(failed)} (see the errors above)", file=sys.stderr)
        return 1
    try:
        worst = results.get(timeout=10)
    except queue.Empty:
        print("weight_sync: FAILED: the inference process reported no result", file=sys.stderr)
        return 1
    print(f"weight_sync: {args.steps} steps in {time.perf_counter() - t0:.1f} s; after every update the "
          f"inference output matched the local reference (largest difference {worst:.2e}, atol {ATOL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
