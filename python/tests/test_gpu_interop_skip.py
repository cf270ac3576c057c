"""gpu_interop.py, gpu_lifetimes.py, gpu_sleep.py and gpu_service_chaos.py (the GPU checks) on a machine that
cannot run them: one line saying what is missing and exit status 77
(skipped), not thousands of lines of tracebacks. No GPU: the driver is
disabled."""

import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "gpu_interop.py")


class WithoutADriver(unittest.TestCase):
    def run_script(self, *args, script=SCRIPT):
        env = dict(os.environ, CUDA_IPC_DISABLE_DRIVER="1",
                   PYTHONPATH=os.pathsep.join(p for p in (_path.PACKAGE_PARENT, os.environ.get("PYTHONPATH")) if p))
        return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120, env=env)

    def test_one_line_and_exit_77(self):
        out = self.run_script()
        self.assertEqual(out.returncode, 77, out.stdout + out.stderr)
        self.assertEqual(out.stderr, "")
        lines = out.stdout.splitlines()
        self.assertEqual(len(lines), 1, out.stdout)
        self.assertTrue(lines[0].startswith("gpu_interop: skipped: it needs the CUDA driver and a GPU: "), lines[0])
        self.assertIn("CUDA_IPC_DISABLE_DRIVER is set", lines[0])

    def test_the_lifetime_checks_say_so_too(self):
        out = self.run_script(script=os.path.join(HERE, "gpu_lifetimes.py"))
        self.assertEqual(out.returncode, 77, out.stdout + out.stderr)
        self.assertEqual(out.stderr, "")
        lines = out.stdout.splitlines()
        self.assertEqual(len(lines), 1, out.stdout)
        self.assertTrue(lines[0].startswith("gpu_lifetimes: skipped: it needs the CUDA driver and a GPU: "),
                        lines[0])

    def test_the_sleep_check_says_so_too(self):
        out = self.run_script(script=os.path.join(HERE, "gpu_sleep.py"))
        self.assertEqual(out.returncode, 77, out.stdout + out.stderr)
        self.assertEqual(out.stderr, "")
        lines = out.stdout.splitlines()
        self.assertEqual(len(lines), 1, out.stdout)
        self.assertTrue(lines[0].startswith("gpu_sleep: skipped: it needs the CUDA driver and a GPU: "), lines[0])

    def test_the_service_chaos_run_says_so_too(self):
        out = self.run_script("--cli", "/nonexistent/cuda-ipc", "--rounds", "1",
                              script=os.path.join(HERE, "gpu_service_chaos.py"))
        self.assertEqual(out.returncode, 77, out.stdout + out.stderr)
        self.assertEqual(out.stderr, "")
        lines = out.stdout.splitlines()
        self.assertEqual(len(lines), 1, out.stdout)
        self.assertTrue(lines[0].startswith("gpu_service_chaos: skipped: it needs the CUDA driver and a GPU: "),
                        lines[0])

    def test_listing_the_cases_needs_no_gpu(self):
        out = self.run_script("--list")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("example torch_consumer (Rust maps a PyTorch export)", out.stdout)


if __name__ == "__main__":
    unittest.main()
