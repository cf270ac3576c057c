"""export_torch and export_cupy without torch or cupy installed: an
ImportError that says what to install, not a bare ModuleNotFoundError."""

import os
import subprocess
import sys
import unittest

import _path  # noqa: F401

import cuda_ipc  # noqa: E402

# A module finder that hides torch and cupy even where they are installed.
HIDE = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "cupy"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
sys.path.insert(0, %r)
import cuda_ipc
for fn, what, install in ((cuda_ipc.export_torch, "torch", "python[torch]"),
                          (cuda_ipc.export_cupy, "cupy", "cupy-cuda13x")):
    try:
        fn(object())
    except ImportError as e:
        assert isinstance(e, cuda_ipc.MissingDependency), type(e)
        assert isinstance(e, cuda_ipc.CudaIpcError), type(e)
        assert what in str(e) and install in str(e), str(e)
        assert "pip install" in str(e), str(e)
    else:
        raise AssertionError(f"{fn.__name__} did not raise")
print("ok")
"""


class MissingDependencies(unittest.TestCase):
    def test_export_without_torch_or_cupy_says_what_to_install(self):
        code = HIDE % _path.PACKAGE_PARENT
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "ok")

    def test_missing_dependency_is_an_import_error(self):
        self.assertTrue(issubclass(cuda_ipc.MissingDependency, ImportError))
        self.assertTrue(issubclass(cuda_ipc.MissingDependency, cuda_ipc.CudaIpcError))


class Packaging(unittest.TestCase):
    def test_the_cupy_extra_is_the_cuda_13_wheel(self):
        with open(os.path.join(_path.PYTHON_DIR, "pyproject.toml")) as f:
            text = f.read()
        self.assertIn('cupy = ["cupy-cuda13x"]', text)
        self.assertNotIn("cupy-cuda12x", text)


if __name__ == "__main__":
    unittest.main()
