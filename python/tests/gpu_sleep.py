"""GPU check of sleep and wake from Python: a reader attaches a state dict,
captures a CUDA graph that reads the tensors, is refused a sleep while the
tensors are alive, sleeps with ``unchecked=True`` (every mapping unmapped,
addresses and leases kept), is refused a new attach while asleep, wakes,
and replays the graph: the tensors have the same addresses and the graph
reads what the publisher wrote while the reader slept. Then it releases
the state dict and sleeps without ``unchecked`` (the cached chunks), and a
state dict attached after the wake has the same addresses.

    python3 gpu_sleep.py [--mib 64]

Two processes: this script as the publisher, and itself again as the
reader (``--reader SOCKET``), talking JSON lines. Needs a CUDA GPU, torch
and the cuda_ipc package; exits 77 with one sentence when one is missing
(gpu_interop.py's check).
Prints what it checked and "N passed, M failed" last.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

NAME = "weights"
KEYS = ("w0", "w1", "w2")


def reader_main(path):
    import cuda_ipc
    import torch

    torch.cuda.init()
    sub = cuda_ipc.Subscriber(path, timeout=30)

    def send(obj):
        print(json.dumps(obj), flush=True)

    sd = sub.attach_state_dict(NAME)
    x = torch.zeros_like(sd["w0"])
    out = torch.empty_like(sd["w0"])
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.copy_(sd["w0"] * 2 + x)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out.copy_(sd["w0"] * 2 + x)
    graph.replay()
    torch.cuda.synchronize()
    ptrs = [sd[k].data_ptr() for k in KEYS]
    send({"attached": True, "ptrs": ptrs, "graph_out": out[0, 0].item(),
          "sums": [sd[k].sum(dtype=torch.float64).item() for k in KEYS]})
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op in ("sleep", "sleep_unchecked"):
                t = time.monotonic()
                try:
                    mappings, nbytes = sub.sleep(unchecked=op == "sleep_unchecked")
                except cuda_ipc.CudaIpcError as e:
                    send({"refused": True, "error": str(e), "type": type(e).__name__,
                          "asleep": sub.asleep, "sums": [sd[k].sum(dtype=torch.float64).item() for k in KEYS]})
                    continue
                send({"mappings": mappings, "bytes": nbytes, "asleep": sub.asleep,
                      "ms": (time.monotonic() - t) * 1e3})
            elif op == "module":
                # A model on the weights, called while they sleep: a clear
                # error before anything is queued; the context stays whole.
                model = torch.nn.Linear(sd["w0"].shape[1], sd["w0"].shape[0], bias=False, device=sd["w0"].device)
                model.weight = torch.nn.Parameter(sd["w0"], requires_grad=False)
                try:
                    with torch.no_grad():
                        model(x[:1])
                    send({"raised": None})
                except cuda_ipc.Asleep as e:
                    torch.cuda.synchronize()  # the context is fine
                    free = torch.ones(4, device="cuda").sum().item()
                    send({"raised": "Asleep", "error": str(e), "context_ok": free == 4.0})
                del model
            elif op == "wake_only":
                mappings, nbytes = sub.wake()
                send({"mappings": mappings, "asleep": sub.asleep})
            elif op == "release":
                sd.release()
                del sd
                send({"released": True})
            elif op == "attach_new":
                sd = sub.attach_state_dict(NAME)
                send({"ptrs": [sd[k].data_ptr() for k in KEYS],
                      "sums": [sd[k].sum(dtype=torch.float64).item() for k in KEYS]})
            elif op == "attach_again":
                try:
                    sub.attach_state_dict(NAME)
                    send({"attached": True})
                except cuda_ipc.CudaIpcError as e:
                    send({"attached": False, "error": str(e), "type": type(e).__name__})
            elif op == "wake":
                t = time.monotonic()
                mappings, nbytes = sub.wake()
                ms = (time.monotonic() - t) * 1e3
                graph.replay()
                torch.cuda.synchronize()
                send({"mappings": mappings, "bytes": nbytes, "asleep": sub.asleep, "ms": ms,
                      "ptrs": [sd[k].data_ptr() for k in KEYS], "graph_out": out[0, 0].item(),
                      "graph_all": bool((out == out[0, 0]).all().item()),
                      "sums": [sd[k].sum(dtype=torch.float64).item() for k in KEYS]})
            else:
                send({"error": "unknown op %r" % op})
        except Exception as e:  # reported to the publisher, which fails the check
            send({"error": "%s: %s" % (type(e).__name__, e)})
    return 0


class Checks:
    def __init__(self):
        self.passed, self.failed = 0, 0

    def check(self, ok, what, detail=""):
        if ok:
            self.passed += 1
            print("PASS  %s" % what)
        else:
            self.failed += 1
            print("FAIL  %s %s" % (what, detail))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB per tensor (3 tensors)")
    ap.add_argument("--reader", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reader:
        return reader_main(args.reader)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_interop import EXIT_SKIPPED, missing_requirement

    missing = missing_requirement()
    if missing:
        print("gpu_sleep: skipped: %s" % missing, flush=True)
        return EXIT_SKIPPED
    import cuda_ipc
    import torch
    path = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-sleep-"), "p.sock")
    # Read-only readers: the arena is made of vmm chunks, which sleep.
    pub = cuda_ipc.Publisher(path, read_only_readers=True)
    n = args.mib * (1 << 20) // 4
    side = (n // 1024, 1024)
    published = pub.publish_state_dict(NAME, {k: torch.full(side, 1.0, device="cuda") for k in KEYS})
    torch.cuda.synchronize()
    c = Checks()
    p = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), "--reader", path],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(op):
        if op is not None:
            p.stdin.write(json.dumps({"op": op}) + "\n")
            p.stdin.flush()
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("the reader exited (status %s)" % p.wait(30))
        r = json.loads(line)
        print("  %s -> %s" % (op or "attach", {k: v for k, v in r.items() if k != "ptrs"}))
        return r

    try:
        first = ask(None)
        c.check(first.get("graph_out") == 2.0 and first["sums"] == [float(n)] * 3,
                "the reader's graph and sums read the published values", first)
        refused = ask("sleep")
        c.check(refused.get("refused") and refused.get("type") == "InvalidInput" and not refused["asleep"]
                and refused.get("sums") == [float(n)] * 3,
                "a sleep is refused while the tensors are alive, and they still read", refused)
        slept = ask("sleep_unchecked")
        c.check("error" not in slept and slept["asleep"] and slept["mappings"] >= 1
                and slept["bytes"] >= 3 * n * 4, "sleep(unchecked=True) unmaps every chunk", slept)
        module = ask("module")
        c.check(module.get("raised") == "Asleep" and "Linear's parameter weight" in module.get("error", "")
                and module.get("context_ok"),
                "a module called on sleeping weights raises cuda_ipc.Asleep, and the context goes on", module)
        again = ask("attach_again")
        c.check(again.get("attached") is False and "wake()" in again.get("error", ""),
                "an attach while asleep is refused, naming wake()", again)
        # Written in place while the reader sleeps (no update notice: the
        # reader reads after its wake, after this synchronize).
        for k in KEYS:
            published[k].fill_(3.0)
        torch.cuda.synchronize()
        woke = ask("wake")
        c.check("error" not in woke and not woke["asleep"] and woke["mappings"] == slept["mappings"],
                "wake maps every chunk again", woke)
        c.check(woke.get("ptrs") == first["ptrs"], "the tensors keep their addresses")
        c.check(woke.get("graph_out") == 6.0 and woke.get("graph_all"),
                "the graph captured before the sleep reads the new values after the wake", woke)
        c.check(woke.get("sums") == [3.0 * n] * 3, "every tensor holds what the publisher wrote meanwhile", woke)
        c.check(ask("release").get("released"), "the state dict is released")
        cached = ask("sleep")
        c.check("error" not in cached and cached["asleep"] and cached["mappings"] >= 1,
                "with no tensor left, a sleep without unchecked unmaps the cached chunks", cached)
        for k in KEYS:
            published[k].fill_(5.0)
        torch.cuda.synchronize()
        woke_cached = ask("wake_only")
        c.check(woke_cached.get("mappings") == cached.get("mappings") and not woke_cached.get("asleep"),
                "the cached chunks wake", woke_cached)
        fresh = ask("attach_new")
        c.check(fresh.get("ptrs") == first["ptrs"] and fresh.get("sums") == [5.0 * n] * 3,
                "a state dict attached after the wake has the same addresses and the new values", fresh)
        print("wake of %.1f MiB in %.3f ms (sleep %.3f ms)" % (woke.get("bytes", 0) / 2**20, woke.get("ms", -1),
                                                           slept.get("ms", -1)))
    except Exception as e:
        c.check(False, "the run", "%s: %s" % (type(e).__name__, e))
    finally:
        p.stdin.close()
        p.wait(60)
        pub.unpublish(NAME, timeout=30)
        pub.close()
    print("%d passed, %d failed" % (c.passed, c.failed))
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
