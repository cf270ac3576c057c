"""The shareable torch allocator without a GPU: the two C functions are
exported by the extension's shared object under the names the package
gives torch, they fail cleanly (null, a reason kept for Python) when no
publisher is active, a free of an unknown address is recorded and ignored,
and neither `import cuda_ipc` nor `cuda_ipc.torch` imports torch."""

import ctypes
import os
import subprocess
import sys
import unittest

import _path  # noqa: F401

import cuda_ipc  # noqa: E402
from cuda_ipc import _core  # noqa: E402


def _functions():
    lib = ctypes.CDLL(_core.__file__)
    alloc = getattr(lib, _core.SHAREABLE_ALLOC)
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = getattr(lib, _core.SHAREABLE_FREE)
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return alloc, free


class CFunctions(unittest.TestCase):
    def setUp(self):
        _core.shareable_error()  # forget an earlier test's

    def test_exported_under_the_names_torch_is_given(self):
        self.assertEqual((_core.SHAREABLE_ALLOC, _core.SHAREABLE_FREE),
                         ("cuda_ipc_torch_alloc", "cuda_ipc_torch_free"))
        alloc, free = _functions()
        self.assertIsNotNone(ctypes.cast(alloc, ctypes.c_void_p).value)
        self.assertIsNotNone(ctypes.cast(free, ctypes.c_void_p).value)

    def test_alloc_without_an_active_publisher_returns_null_and_says_why(self):
        alloc, _ = _functions()
        self.assertFalse(_core.shareable_active(3))
        self.assertIsNone(alloc(1 << 20, 3, None))
        msg = cuda_ipc.torch.last_error()
        self.assertIn("could not allocate 1048576 bytes on cuda:3", msg)
        self.assertIn("no publisher is active on cuda:3", msg)
        self.assertIn("cuda_ipc.torch.shareable(publisher)", msg)
        self.assertIsNone(cuda_ipc.torch.last_error(), "read once")
        self.assertEqual(cuda_ipc.torch.segments(), (0, 0))

    def test_free_of_an_unknown_address_is_recorded_and_ignored(self):
        _, free = _functions()
        free(0x7F0000001000, 4096, 0, None)
        msg = _core.shareable_error()
        self.assertIn("0x7f0000001000 is not a segment this allocator handed out", msg)
        free(None, 0, 0, None)
        self.assertIn("0x0", _core.shareable_error())


HIDE = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
sys.path.insert(0, %r)
import cuda_ipc
import cuda_ipc.torch
assert cuda_ipc.torch.segments() == (0, 0)
try:
    with cuda_ipc.torch.shareable(object()):
        pass
except ImportError as e:
    assert isinstance(e, cuda_ipc.MissingDependency), type(e)
    assert "pip install" in str(e), str(e)
else:
    raise AssertionError("shareable did not raise")
assert "torch" not in sys.modules
print("ok")
"""


class Imports(unittest.TestCase):
    def test_cuda_ipc_torch_does_not_import_torch(self):
        code = HIDE % _path.PACKAGE_PARENT
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ))
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "ok")

    def test_the_attribute_is_the_module(self):
        import cuda_ipc.torch as m

        self.assertIs(cuda_ipc.torch, m)
        self.assertTrue(callable(m.shareable))
        with self.assertRaises(AttributeError):
            cuda_ipc.no_such_thing  # noqa: B018


if __name__ == "__main__":
    unittest.main()


class _Fake:
    """What reserve_bytes reads of a tensor (torch is not installed here)."""

    def __init__(self, numel, size=4):
        self._n, self._size = numel, size

    def numel(self):
        return self._n

    def element_size(self):
        return self._size


class ReserveBytes(unittest.TestCase):
    MIB = 1 << 20

    def test_large_blocks_round_to_2_mib_and_small_ones_pack(self):
        rb = cuda_ipc.torch.reserve_bytes
        # 3 MiB + 1 byte of u8 -> 4 MiB; two 4 KiB fp32 biases -> 8 KiB of
        # small blocks -> one 2 MiB segment; and one 20 MiB segment of slack.
        got = rb([_Fake(3 * self.MIB + 1, 1), _Fake(1024), _Fake(1024)])
        self.assertEqual(got, 4 * self.MIB + 2 * self.MIB + 20 * self.MIB)
        # Small blocks round to 512 bytes before packing: 5,000 of 600 bytes
        # take 1,024 each, 5,000 KiB, three 2 MiB segments; no large block,
        # no slack.
        self.assertEqual(rb([_Fake(600, 1) for _ in range(5000)]), 6 * self.MIB)
        self.assertEqual(rb([]), 0)
        self.assertEqual(rb([_Fake(0)]), 0, "an empty tensor takes no block")

    def test_tied_tensors_count_once_and_dicts_and_modules_are_read(self):
        rb = cuda_ipc.torch.reserve_bytes
        w = _Fake(self.MIB)  # 4 MiB of fp32
        self.assertEqual(rb({"a": w, "b": w}), rb([w]))
        self.assertEqual(rb([w]), 4 * self.MIB + 20 * self.MIB)

        class Module:
            def parameters(self):
                return iter([w])

            def buffers(self):
                return iter([_Fake(10)])

        self.assertEqual(rb(Module()), 4 * self.MIB + 2 * self.MIB + 20 * self.MIB)

    def test_what_is_not_a_tensor_is_named(self):
        with self.assertRaises(cuda_ipc.InvalidInput) as e:
            cuda_ipc.torch.reserve_bytes([_Fake(1), "weights"])
        self.assertIn("expected tensors, found str", str(e.exception))

    def test_shareable_refuses_a_bad_reserve_before_importing_torch(self):
        for bad in (-1, 1.5, "1GiB", True):
            with self.assertRaises(cuda_ipc.InvalidInput) as e:
                with cuda_ipc.torch.shareable(object(), reserve=bad):
                    self.fail("the block ran")
            self.assertIn("reserve is a number of bytes", str(e.exception))
