"""The ``example`` cases of gpu_interop.py (a GPU host runs them; not a
script): the Rust examples ``torch_consumer`` (maps a PyTorch export,
transforms it, answers with an event) and ``torch_producer`` (exports to
PyTorch, waits on PyTorch's event, checks), when ``--examples`` (default:
``examples/`` next to ``--cli``) has them.

gpu_interop.py's Worker takes the ops from :class:`ExampleOps` and its
Runner the cases from :class:`ExampleCases`.
"""

import json
import os
import subprocess

from gpu_harness import CaseError, Skip, _compare, _finish, _readline
from gpu_mechanisms import LAYOUTS, values_np


class ExampleOps:
    """The examples' ops: methods of gpu_interop's Worker."""

    def op_verify_transformed(self, case, event):
        """After the Rust torch_consumer example applied x -> 2x + 1 to the
        exported int32 view and recorded `event`: wait on it, check every
        element of the base (the view transformed, the rest untouched)."""
        np, torch = self.np, self.torch
        s = self.state[case]
        done = torch.cuda.Event.from_ipc_handle(s["base"].device, bytes.fromhex(event))
        done.wait(torch.cuda.current_stream())
        expected = values_np(np, s["shape"], "int32")
        target = LAYOUTS[s["layout"]][1](expected)
        target[...] = target * 2 + 1
        return _compare(np, s["base"].cpu().numpy(), expected, "base")

    def op_consume_producer(self, case, descriptor):
        """The Python side of the torch_producer example: map, check
        1000 + i, apply 2x + 1, record an interprocess event; the mapping
        and the event stay alive until drop_consumer."""
        torch, ci = self.torch, self.ci
        m = ci.open(descriptor)
        t = m.as_torch()
        if t.dtype != torch.int32:
            raise AssertionError(f"as_torch() gave {t.dtype}, expected torch.int32")
        expected = torch.arange(t.numel(), device=t.device, dtype=torch.int32).view_as(t) + 1000
        if not torch.equal(t, expected):
            bad = (t != expected).flatten().nonzero()
            raise AssertionError(f"element {int(bad[0])} is not 1000 + its index")
        t.mul_(2).add_(1)
        ev = torch.cuda.Event(interprocess=True)
        ev.record()
        self.state[case] = dict(m=m, t=t, ev=ev)
        return {"event": bytes(ev.ipc_handle()).hex(), "shape": list(t.shape)}

    def op_drop_consumer(self, case):
        s = self.state.pop(case, None)
        if s is not None:
            s["m"].close()
            del s
        import gc

        gc.collect()
        self.ci.settle(10)
        live = self.ci.live_mappings()
        self._empty_caches()
        if live:
            raise AssertionError(f"{live} mapping(s) still open")
        return {}


class ExampleCases:
    """The examples' cases: methods of gpu_interop's Runner."""

    def example(self, name):
        path = os.path.join(self.args.examples or "", name)
        if not self.args.examples or not os.access(path, os.X_OK):
            raise Skip(f"no {name} example (give --examples DIR; default: examples/ next to --cli)")
        return path

    def example_torch_consumer(self):
        exe = self.example("torch_consumer")
        self.need("a", "torch")
        case = self.case_id()
        a = self.w("a")
        exp = a.call("export", case=case, framework="torch", dtype="int32", layout="slice1d", fill="values")
        p = subprocess.Popen([exe], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            p.stdin.write(json.dumps(exp["descriptor"]) + "\n")
            p.stdin.flush()
            event = _readline(p, 120, "torch_consumer")
            r = a.call("verify_transformed", case=case, event=event)
        except BaseException:
            p.kill()
            p.wait(30)
            self._drop(a, case)
            raise
        _finish(p, "torch_consumer")
        a.call("release", case=case)
        return f"{r['elements']} elements checked"

    def example_torch_producer(self, mechanism):
        exe = self.example("torch_producer")
        self.need("b", "torch")
        case = self.case_id()
        b = self.w("b")
        p = subprocess.Popen([exe, "--size", "4MiB", "--mechanism", mechanism], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            d = json.loads(_readline(p, 120, "torch_producer"))
            r = b.call("consume_producer", case=case, descriptor=d)
            p.stdin.write(r["event"] + "\n")
            p.stdin.flush()
            verdict = _readline(p, 120, "torch_producer")
            b.call("drop_consumer", case=case)
            if "are 2x + 1" not in verdict:
                raise CaseError(verdict)
        except BaseException:
            p.kill()
            p.wait(30)
            self._drop_consumer(b, case)
            raise
        _finish(p, "torch_producer")
        return f"{d['mechanism']} {r['shape']}: {verdict}"

    def _drop_consumer(self, worker, case):
        try:
            worker.call("drop_consumer", case=case, timeout=60)
        except Exception:
            pass
