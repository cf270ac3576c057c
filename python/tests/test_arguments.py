"""Bad arguments are a CudaIpcError (InvalidInput, also ValueError) raised
before the driver is loaded, never OverflowError or TypeError from the
bindings, and never "no driver" for a mistake the CLI reports as bad input;
and a machine without libcuda is told so, not told to remove a stray file.
No GPU."""

import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402
from test_errors import DESCRIPTOR, _cli  # noqa: E402

import cuda_ipc  # noqa: E402


class Arguments(unittest.TestCase):
    def assertInvalid(self, fn, *words):
        with self.assertRaises(cuda_ipc.InvalidInput) as cm:
            fn()
        self.assertIsInstance(cm.exception, ValueError)
        self.assertEqual(cm.exception.kind, "invalid_input")
        for w in words:
            self.assertIn(w, str(cm.exception))
        return str(cm.exception)

    def test_device_ordinals(self):
        sock = os.path.join(tempfile.gettempdir(), "cuda-ipc-arguments-test.sock")
        calls = {
            "open": lambda d: cuda_ipc.open(DESCRIPTOR, device=d),
            "device_uuid": lambda d: cuda_ipc.device_uuid(d),
            "mem_info": lambda d: cuda_ipc.mem_info(d),
            "export_memory": lambda d: cuda_ipc._core.export_memory(0x7F0000000000, "f32", [16], device=d),
            "Publisher": lambda d: cuda_ipc.Publisher(sock, device=d),
            "Subscriber": lambda d: cuda_ipc.Subscriber(sock, device=d),
        }
        for name, call in calls.items():
            with self.subTest(call=name):
                self.assertInvalid(lambda: call(-1), "invalid device: -1 is negative", "device_count()")
                self.assertInvalid(lambda: call(2 ** 70), "is too large")
                self.assertInvalid(lambda: call("0"), "'0' is a str, not a device ordinal")
                self.assertInvalid(lambda: call(True), "is a bool")

    def test_set_entry_index(self):
        from test_sets import SEEDS, seeds  # the fuzz target's valid set records
        names = seeds("seed-valid")
        if not names:
            self.skipTest("no set record seeds in this checkout")
        with open(os.path.join(SEEDS, names[0]), "rb") as f:
            rec = cuda_ipc.sets.parse_set_record(f.read())
        for bad, words in ((-1, ("invalid index: -1 is negative",)), (2 ** 70, ("is too large",)),
                           ("0", ("is a str",)), (False, ("is a bool",))):
            with self.subTest(index=bad):
                self.assertInvalid(lambda: cuda_ipc.sets.set_entry_descriptor(rec, bad), *words)

    def test_allowed_user_ids(self):
        sock = os.path.join(tempfile.gettempdir(), "cuda-ipc-arguments-test.sock")
        for cls in (cuda_ipc.Publisher, cuda_ipc.Subscriber):
            with self.subTest(cls=cls.__name__):
                self.assertInvalid(lambda: cls(sock, allow_uids=[-1]), "invalid allow_uids: -1 is negative",
                                   "os.getuid()")
                self.assertInvalid(lambda: cls(sock, allow_uids=[0, 2 ** 32]), "is too large")
                self.assertInvalid(lambda: cls(sock, allow_uids=[2 ** 32 - 1]), "names no user")
                self.assertInvalid(lambda: cls(sock, allow_uids=[1.5]), "is a float")

    def test_read_only_options(self):
        """``read_only_readers`` (publisher), ``read_only`` (subscriber, and
        per attach): keyword-only, and a good one gets as far as the driver."""
        import inspect
        from cuda_ipc import channel
        for fn, name in ((channel.Publisher.__init__, "read_only_readers"),
                         (channel.Subscriber.__init__, "read_only"),
                         (channel.Subscriber.attach_set, "read_only"),
                         (channel.Subscriber.attach_state_dict, "read_only")):
            with self.subTest(fn=fn.__qualname__):
                p = inspect.signature(fn).parameters[name]
                self.assertEqual(p.kind, inspect.Parameter.KEYWORD_ONLY)
                self.assertIs(p.default, False)
        if cuda_ipc.driver_available():
            self.skipTest("a driver is here: the no-driver path is not this machine's")
        sock = os.path.join(tempfile.gettempdir(), "cuda-ipc-arguments-test.sock")
        for make in (lambda: cuda_ipc.Publisher(sock, read_only_readers=True),
                     lambda: cuda_ipc.Subscriber(sock, read_only=True)):
            with self.assertRaises(cuda_ipc.Unavailable) as cm:
                make()
            self.assertIn("libcuda", str(cm.exception))

    def test_a_bad_socket_name_is_bad_input_as_in_the_cli(self):
        # Checked before the driver: bad input even where the driver is missing.
        for cls in (cuda_ipc.Publisher, cuda_ipc.Subscriber):
            with self.subTest(cls=cls.__name__):
                msg = self.assertInvalid(lambda: cls("bad name!"), '"bad name!" is not a socket name',
                                         "or give a path containing a /")
        cli = _cli()
        if cli is None:
            self.skipTest("the cuda-ipc command is not built (cargo build)")
        out = subprocess.run([cli, "attach", "--socket", "bad name!"], capture_output=True, text=True,
                             env=dict(os.environ, CUDA_IPC_DISABLE_DRIVER="1"), timeout=60)
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn(msg.split("is not a socket name", 1)[1], out.stderr)

    def test_storage_handles_of_every_type(self):
        c_handle = bytes([2]) + b"c" + bytes(range(1, 65))
        want = {"type": "c", "version": 2, "handle": bytes(range(1, 65))}
        for data in (c_handle, bytearray(c_handle), memoryview(c_handle), c_handle.hex(), c_handle.hex().upper()):
            with self.subTest(type=type(data).__name__):
                self.assertEqual(cuda_ipc.parse_storage_handle(data), want)
        with self.assertRaisesRegex(cuda_ipc.TorchRecordError, "version byte and a type byte"):
            cuda_ipc.parse_storage_handle("00")
        with self.assertRaisesRegex(cuda_ipc.TorchRecordError, "the text is not hex"):
            cuda_ipc.parse_storage_handle("zz")
        for bad in (5, None, [2, 99]):
            with self.subTest(bad=bad), self.assertRaisesRegex(cuda_ipc.TorchRecordError, "is bytes"):
                cuda_ipc.parse_storage_handle(bad)


class Loader(unittest.TestCase):
    """Why libcuda did not load, seen from a fresh interpreter with the
    driver enabled and a temporary directory first on the loader path."""

    CODE = (
        "import sys; sys.path.insert(0, %r)\n"
        "import cuda_ipc\n"
        "try:\n"
        "    print('loaded', cuda_ipc.driver_version())\n"
        "except cuda_ipc.DriverNotFound as e:\n"
        "    print(e)\n"
    )

    def driver_message(self, folder):
        env = {k: v for k, v in os.environ.items() if k != "CUDA_IPC_DISABLE_DRIVER"}
        env["LD_LIBRARY_PATH"] = folder
        out = subprocess.run([sys.executable, "-c", self.CODE % _path.PACKAGE_PARENT], capture_output=True,
                             text=True, timeout=60, env=env)
        self.assertEqual(out.returncode, 0, out.stderr)
        return out.stdout.strip()

    def test_a_stray_file_is_named(self):
        with tempfile.TemporaryDirectory() as d:
            stray = os.path.join(d, "libcuda.so.1")
            with open(stray, "wb") as f:
                f.write(b"not an ELF file")
            msg = self.driver_message(d)
        self.assertIn("a file named libcuda.so.1 was found at %s but it is not a loadable library" % stray, msg)
        self.assertIn("remove the stray file", msg)

    def test_no_libcuda_is_not_a_stray_file(self):
        with tempfile.TemporaryDirectory() as d:
            msg = self.driver_message(d)
        self.assertNotIn("not a loadable library", msg)
        if msg.startswith("loaded"):
            self.skipTest("libcuda loads on this machine")
        self.assertIn("no library named libcuda.so.1 (or libcuda.so) was found on the loader path", msg)


if __name__ == "__main__":
    unittest.main()
