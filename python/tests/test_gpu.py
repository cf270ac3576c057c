"""Smoke tests on a real GPU, skipped (with the reason) where libcuda.so.1,
a device, PyTorch or CuPy is missing. The full cross-language matrix is
gpu_interop.py (run it with --cli PATH_TO_cuda-ipc)."""

import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402

import cuda_ipc  # noqa: E402


def _has(module):
    try:
        __import__(module)
        return True
    except Exception:
        return False


def _driver_reason():
    try:
        count = cuda_ipc.device_count()
    except cuda_ipc.CudaIpcError as e:
        return f"no usable CUDA driver here ({str(e).split('. ')[0]})"
    if count == 0:
        return "the CUDA driver sees no device"
    return None


REASON = _driver_reason()

EXPORTER = r"""
import sys, json, torch
sys.path.insert(0, %(path)r)
import cuda_ipc
x = torch.arange(4096, dtype=torch.float32, device="cuda")
t = x[1024:3072].view(32, 64)
e = cuda_ipc.export_torch(t)
print(e.json(), flush=True)
sys.stdin.readline()
torch.cuda.synchronize()
ok = bool((t == 7).all().item()) and bool((x[:1024] == torch.arange(1024, device="cuda", dtype=torch.float32)).all().item())
e.close()
print(json.dumps({"ok": ok}), flush=True)
"""


@unittest.skipIf(REASON is not None, REASON or "")
class Driver(unittest.TestCase):
    def test_devices_have_uuids(self):
        for i in range(cuda_ipc.device_count()):
            self.assertRegex(cuda_ipc.device_uuid(i), r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-")
            free, total = cuda_ipc.mem_info(i)
            self.assertLess(0, free)
            self.assertLessEqual(free, total)

    def test_bogus_handle_is_an_error_not_a_crash(self):
        uuid = cuda_ipc.device_uuid(0)
        d = {"cuda_ipc": 1, "mechanism": "legacy", "handle": "5a" * 64, "alloc_size": 4096,
             "offset": 0, "len": 64, "dtype": "u8", "device_uuid": uuid, "pid": 1}
        with self.assertRaises(cuda_ipc.DriverError) as cm:
            cuda_ipc.open(d)
        self.assertEqual(cm.exception.call, "cuIpcOpenMemHandle")
        self.assertEqual(cuda_ipc.live_mappings(), 0)


@unittest.skipIf(REASON is not None, REASON or "")
@unittest.skipUnless(_has("torch"), "PyTorch is not installed")
class TorchRoundTrip(unittest.TestCase):
    def test_map_a_slice_exported_by_another_process(self):
        import torch

        p = subprocess.Popen([sys.executable, "-c", EXPORTER % {"path": _path.PACKAGE_PARENT}],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            d = json.loads(p.stdout.readline())
            self.assertEqual(d["mechanism"], "legacy")
            self.assertEqual(d["shape"], [32, 64])
            t = cuda_ipc.open(d).as_torch()
            expected = torch.arange(1024, 3072, dtype=torch.float32, device=t.device).view(32, 64)
            self.assertTrue(torch.equal(t, expected))
            t.fill_(7)
            torch.cuda.synchronize()
            del t
            p.stdin.write("done\n")
            p.stdin.flush()
            self.assertEqual(json.loads(p.stdout.readline()), {"ok": True})
        finally:
            p.stdin.close()
            p.wait(60)
        self.assertTrue(cuda_ipc.settle(10))
        self.assertEqual(cuda_ipc.live_mappings(), 0)


if __name__ == "__main__":
    unittest.main()
