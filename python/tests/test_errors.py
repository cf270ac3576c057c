"""Errors from the Rust core: one class per error kind under CudaIpcError,
the messages the command-line tool prints, and the no-driver path
(CUDA_IPC_DISABLE_DRIVER=1 makes the library behave as if libcuda.so.1 were
missing). No GPU."""

import json
import os
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402

import cuda_ipc  # noqa: E402

UUID = "GPU-12345678-9abc-def0-0102-030405060708"
DESCRIPTOR = {"cuda_ipc": 1, "mechanism": "legacy", "handle": "ab" * 64, "alloc_size": 4096, "offset": 0,
              "len": 64, "dtype": "u8", "device_uuid": UUID, "pid": 1}


def _cli():
    """The cuda-ipc command of this checkout, if built (cargo build / test)."""
    for profile in ("debug", "release"):
        path = os.path.join(_path.REPO, "target", profile, "cuda-ipc")
        if os.access(path, os.X_OK):
            return path
    return shutil.which("cuda-ipc")


def _in_child(code, env=None):
    """Runs `code` in a fresh interpreter (the driver is loaded once per
    process) and returns its stdout."""
    full = dict(os.environ, **(env or {}))
    out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, %r)\n" % _path.PACKAGE_PARENT + code],
                         capture_output=True, text=True, timeout=60, env=full)
    if out.returncode != 0:
        raise AssertionError(out.stderr)
    return out.stdout


class Hierarchy(unittest.TestCase):
    def test_every_class_is_a_cuda_ipc_error(self):
        for name in cuda_ipc.errors.__all__:
            self.assertTrue(issubclass(getattr(cuda_ipc, name), cuda_ipc.CudaIpcError), name)

    def test_kinds(self):
        E = cuda_ipc
        self.assertTrue(issubclass(E.DriverNotFound, E.Unavailable))
        self.assertTrue(issubclass(E.Unsupported, E.Unavailable))
        self.assertTrue(issubclass(E.DescriptorError, E.InvalidInput))
        self.assertTrue(issubclass(E.InvalidInput, ValueError))
        self.assertTrue(issubclass(E.TorchRecordError, E.InvalidInput))
        self.assertTrue(issubclass(E.Timeout, TimeoutError))
        for cls, kind in ((E.DriverUnavailable, E.Unavailable), (E.DriverInvalidInput, E.InvalidInput),
                          (E.DriverPeerGone, E.PeerGone), (E.DriverTimeout, E.Timeout)):
            self.assertTrue(issubclass(cls, E.DriverError) and issubclass(cls, kind), cls)
        self.assertEqual(E.DriverPeerGone.kind, "peer")

    def test_descriptor_error_names_the_field(self):
        with self.assertRaises(cuda_ipc.DescriptorError) as cm:
            cuda_ipc.parse_descriptor({**DESCRIPTOR, "len": -1})
        e = cm.exception
        self.assertEqual(e.field, "len")
        self.assertEqual(e.kind, "invalid_input")
        self.assertIsInstance(e, ValueError)
        self.assertTrue(str(e).startswith("descriptor field `len`: "), str(e))

    def test_bad_documents(self):
        for bad in ("not json", b"\xff\xfe", {"cuda_ipc": 1, "x": object()}, "[]"):
            with self.subTest(bad=repr(bad)[:30]):
                with self.assertRaises(cuda_ipc.DescriptorError):
                    cuda_ipc.parse_descriptor(bad)
                with self.assertRaises(cuda_ipc.CudaIpcError):
                    cuda_ipc.open(bad)

    def test_record_errors(self):
        with self.assertRaises(cuda_ipc.TorchRecordError) as cm:
            cuda_ipc.validate_record({"torch_share": 1})
        self.assertIn("PyTorch share record", str(cm.exception))
        # open() reads a record as a record (its key), before any driver call.
        with self.assertRaises(cuda_ipc.TorchRecordError):
            cuda_ipc.open({"torch_share": 1, "pid": 5})
        with self.assertRaises(cuda_ipc.DescriptorError):
            cuda_ipc.open('{"cuda_ipc": 1, "note": "torch_share"}')

    def test_view_dtype_rules(self):
        from cuda_ipc.mapping import _target

        self.assertEqual(_target("f32", "int32").name, "i32")
        with self.assertRaisesRegex(cuda_ipc.CudaIpcError, "element sizes differ"):
            _target("f32", "f16")
        with self.assertRaisesRegex(cuda_ipc.CudaIpcError, "unknown dtype"):
            _target("f32", "complex32")


@unittest.skipUnless(_cli(), "the cuda-ipc command is not built (cargo build)")
class SameMessagesAsTheCli(unittest.TestCase):
    def cli_message(self, descriptor, env=None):
        out = subprocess.run([_cli(), "open", "--descriptor", descriptor], capture_output=True, text=True,
                             timeout=60, env=dict(os.environ, **(env or {})))
        prefix = "cuda-ipc: error: "
        line = out.stderr.strip().splitlines()[-1]
        self.assertTrue(line.startswith(prefix), out.stderr)
        return out.returncode, line[len(prefix):]

    def test_invalid_descriptors(self):
        cases = [
            json.dumps({"cuda_ipc": 1}),
            json.dumps({**DESCRIPTOR, "mechanism": "carrier-pigeon"}),
            json.dumps({**DESCRIPTOR, "handle": "zz"}),
            json.dumps({**DESCRIPTOR, "offset": 4096}),
            json.dumps({**DESCRIPTOR, "dtype": "f32", "len": 6}),
            json.dumps({**DESCRIPTOR, "cuda_ipc": 99}),
            "{not json",
        ]
        for text in cases:
            with self.subTest(text=text[:60]):
                rc, want = self.cli_message(text)
                self.assertEqual(rc, 2)
                with self.assertRaises(cuda_ipc.InvalidInput) as cm:
                    cuda_ipc.open(text)
                self.assertEqual(str(cm.exception), want)

    def test_no_driver(self):
        rc, want = self.cli_message(json.dumps(DESCRIPTOR), env={"CUDA_IPC_DISABLE_DRIVER": "1"})
        self.assertEqual(rc, 3)
        got = _in_child(
            "import json, cuda_ipc\n"
            "try:\n"
            "    cuda_ipc.open(json.loads(sys.argv[1] if len(sys.argv) > 1 else %r))\n"
            "except cuda_ipc.DriverNotFound as e:\n"
            "    print(str(e))\n" % json.dumps(DESCRIPTOR),
            env={"CUDA_IPC_DISABLE_DRIVER": "1"})
        self.assertEqual(got.strip(), want)


class NoDriver(unittest.TestCase):
    """Every entry point that needs the driver says it is missing, in one
    sentence that says what to do; nothing crashes or hangs."""

    CODE = r"""
import json, cuda_ipc
d = json.loads(%r)
assert not cuda_ipc.driver_available()
# What needs no driver still works.
assert cuda_ipc.parse_descriptor(d)["len"] == 64
calls = {
    "driver_version": lambda: cuda_ipc.driver_version(),
    "device_count": lambda: cuda_ipc.device_count(),
    "device_uuid": lambda: cuda_ipc.device_uuid(0),
    "mem_info": lambda: cuda_ipc.mem_info(0),
    "open": lambda: cuda_ipc.open(d),
    "open_record_text": lambda: cuda_ipc.open(json.dumps(d).encode()),
    "export_memory": lambda: cuda_ipc._core.export_memory(0x7f0000000000, "f32", [16]),
    "Publisher": lambda: cuda_ipc.Publisher("/tmp/cuda-ipc-no-driver-test.sock"),
    "Subscriber": lambda: cuda_ipc.Subscriber("/tmp/cuda-ipc-no-driver-test.sock"),
}
out = {}
for name, fn in calls.items():
    try:
        fn()
        out[name] = "no error"
    except cuda_ipc.DriverNotFound as e:
        assert isinstance(e, cuda_ipc.Unavailable) and e.kind == "unavailable"
        out[name] = str(e)
print(json.dumps(out))
print(cuda_ipc.live_mappings())
"""

    def test_every_entry_point(self):
        lines = _in_child(self.CODE % json.dumps(DESCRIPTOR), env={"CUDA_IPC_DISABLE_DRIVER": "1"}).splitlines()
        got = json.loads(lines[0])
        for name, message in got.items():
            with self.subTest(call=name):
                self.assertIn("CUDA_IPC_DISABLE_DRIVER is set", message)
                self.assertIn("unset it", message)
                self.assertNotIn("Install the NVIDIA driver", message)
        self.assertEqual(lines[1], "0")


if __name__ == "__main__":
    unittest.main()
