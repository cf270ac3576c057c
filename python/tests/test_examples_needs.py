"""The Python examples on a machine without what they need: each says why in
one sentence on standard error and exits 3 within 2 s, before it imports
torch or starts anything. No GPU, no torch: a stand-in torch package (an
empty one, enough for the check) plays an installed PyTorch."""

import os
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402

EXAMPLES = os.path.join(_path.REPO, "examples", "python")
# Each example and the arguments it runs with.
RUNS = {
    "trainer_inference.py": ["train"],
    "weight_sync.py": ["--steps", "3"],
    "service_trainer.py": ["--steps", "3"],
    "service_generate.py": [],
}


def run(example, args, env_extra, stand_ins=()):
    with tempfile.TemporaryDirectory() as fake:
        for name in stand_ins:
            os.makedirs(os.path.join(fake, name))
            open(os.path.join(fake, name, "__init__.py"), "w").close()
        env = dict(os.environ, **env_extra)
        env["PYTHONPATH"] = os.pathsep.join([fake, _path.PACKAGE_PARENT])
        started = time.monotonic()
        done = subprocess.run([sys.executable, os.path.join(EXAMPLES, example), *args], env=env,
                              capture_output=True, text=True, timeout=60)
        return done, time.monotonic() - started


class ExamplesSayWhatTheyNeed(unittest.TestCase):
    def check(self, done, took, example, words):
        self.assertEqual(done.returncode, 3, f"{example}: {done.stderr}")
        lines = done.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, f"{example}: {done.stderr}")
        self.assertTrue(lines[0].startswith(example[:-3] + ": "), lines[0])
        self.assertIn(words, lines[0])
        self.assertLess(took, 2.0, f"{example} took {took:.1f} s to say: {lines[0]}")

    def test_without_torch(self):
        for example, args in RUNS.items():
            with self.subTest(example=example):
                done, took = run(example, args, {})
                if done.returncode == 3 and "torch" not in done.stderr:
                    self.skipTest("torch is installed here")
                self.check(done, took, example, "needs ")

    def test_without_a_driver(self):
        stand_ins = ("torch", "transformers", "safetensors")
        for example, args in RUNS.items():
            with self.subTest(example=example):
                done, took = run(example, args, {"CUDA_IPC_DISABLE_DRIVER": "1"}, stand_ins)
                self.check(done, took, example, "needs an NVIDIA GPU")


if __name__ == "__main__":
    unittest.main()
