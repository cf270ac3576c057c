"""Sets and state dicts without a GPU: the element types a set holds, the
names that carry empty tensors, the argument checks that come before any
driver or torch call, the StateDict object's lease handling (on a stand-in
attachment), and the no-driver path of the set API. No GPU, no torch."""

import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402

import cuda_ipc  # noqa: E402
from cuda_ipc import sets  # noqa: E402


def _has_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


class Dtypes(unittest.TestCase):
    def test_every_torch_type_a_set_holds(self):
        want = {
            "bool": "bool", "uint8": "u8", "int8": "i8", "uint16": "u16", "int16": "i16",
            "uint32": "u32", "int32": "i32", "uint64": "u64", "int64": "i64",
            "float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
            "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "float8_e4m3fnuz": "f8e4m3fnuz",
            "float8_e5m2fnuz": "f8e5m2fnuz", "float8_e8m0fnu": "f8e8m0fnu",
            "float4_e2m1fn_x2": "f4e2m1fnx2", "complex64": "c64", "complex128": "c128",
        }
        for torch_name, name in want.items():
            with self.subTest(dtype=torch_name):
                self.assertEqual(sets.set_dtype(torch_name).name, name)
                self.assertEqual(sets.set_dtype("torch." + torch_name).name, name)
        self.assertEqual(len(want), len(cuda_ipc.dtypes.DTYPES))

    def test_other_types_are_refused_saying_what_to_do(self):
        for bad in ("complex32", "torch.uint4", "int1", "qint8", "float"):
            with self.subTest(dtype=bad):
                with self.assertRaises(cuda_ipc.InvalidInput) as cm:
                    sets.set_dtype(bad, "'layer.w'")
                msg = str(cm.exception)
                self.assertIn("'layer.w'", msg)
                self.assertIn("which a set does not hold", msg)
                self.assertIn("bfloat16", msg)
                self.assertIn("convert it first", msg)
                self.assertIn("t.view(torch.uint8)", msg)
                self.assertIsInstance(cm.exception, ValueError)


class EmptyEntries(unittest.TestCase):
    def test_round_trip(self):
        for key, shape in (("w", (0,)), ("a.b/c", (3, 0, 2)), ("x", (0, 5))):
            with self.subTest(key=key, shape=shape):
                name = sets.empty_entry_name(key, shape)
                self.assertTrue(name.startswith(sets.EMPTY_PREFIX))
                self.assertEqual(sets.parse_empty_entry_name(name), (key, shape))

    def test_not_empty_is_refused(self):
        with self.assertRaises(cuda_ipc.InvalidInput):
            sets.empty_entry_name("w", (2, 3))
        with self.assertRaises(cuda_ipc.InvalidInput):
            sets.empty_entry_name("w", ())

    def test_other_names_are_not_empty_entries(self):
        for name in ("w", "layer.0.weight", ".cuda-ipc/empty/", ".cuda-ipc/empty/3/w", ".cuda-ipc/empty/0",
                     ".cuda-ipc/empty/ax0/w", ".cuda-ipc/empty/0x-1/w", ".cuda-ipc/chunk/1/2"):
            with self.subTest(name=name):
                self.assertIsNone(sets.parse_empty_entry_name(name))


class AliasEntries(unittest.TestCase):
    def test_round_trip(self):
        for index, key in ((0, "lm_head.weight"), (12, "a/b.c"), (999, "x")):
            with self.subTest(index=index, key=key):
                name = sets.alias_entry_name(index, key)
                self.assertTrue(name.startswith(sets.ALIAS_PREFIX))
                self.assertEqual(sets.parse_alias_entry_name(name), (index, key))

    def test_a_bad_index_is_refused(self):
        for index in (-1, "3", 1.0, None):
            with self.subTest(index=index):
                with self.assertRaises(cuda_ipc.InvalidInput):
                    sets.alias_entry_name(index, "w")

    def test_other_names_are_not_aliases(self):
        for name in ("w", "layer.0.weight", ".cuda-ipc/alias/", ".cuda-ipc/alias/3", ".cuda-ipc/alias/3/",
                     ".cuda-ipc/alias/x/w", ".cuda-ipc/alias/-1/w", ".cuda-ipc/empty/0/w"):
            with self.subTest(name=name):
                self.assertIsNone(sets.parse_alias_entry_name(name))


class _StubCore:
    """Stands in for _core.Publisher: records calls, allocates nothing."""

    device = 0

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return None
        return call


def _publisher():
    p = cuda_ipc.Publisher.__new__(cuda_ipc.Publisher)
    p._c = _StubCore()
    p._sets, p._state_dicts = set(), {}
    return p


class PublishChecks(unittest.TestCase):
    """What publish_state_dict and update_state_dict refuse before they
    touch the driver or torch."""

    def test_bad_names(self):
        p = _publisher()
        for name in ("", None, 3, "x" * 300):
            with self.subTest(name=repr(name)[:20]):
                with self.assertRaises(cuda_ipc.InvalidInput):
                    p.publish_state_dict(name, {"w": object()})
        self.assertEqual(p._c.calls, [])

    def test_bad_state_dicts(self):
        p = _publisher()
        cases = {
            "empty": ({}, "is empty"),
            "not a mapping": ([1, 2], "expected a state dict"),
            "key not a string": ({3: object()}, "non-empty strings"),
            "empty key": ({"": object()}, "non-empty strings"),
            "reserved key": ({sets.EMPTY_PREFIX + "0/w": object()}, "reserved"),
            "reserved alias key": ({sets.ALIAS_PREFIX + "0/w": object()}, "reserved"),
            "reserved prefix": ({".cuda-ipc/other": object()}, "reserved"),
        }
        for what, (sd, text) in cases.items():
            with self.subTest(what):
                with self.assertRaises(cuda_ipc.InvalidInput) as cm:
                    p.publish_state_dict("model", sd)
                self.assertIn(text, str(cm.exception))
        self.assertEqual(p._c.calls, [])

    @unittest.skipIf(_has_torch(), "torch is installed here")
    def test_without_torch_says_what_to_install(self):
        p = _publisher()
        with self.assertRaises(cuda_ipc.MissingDependency) as cm:
            p.publish_state_dict("model", {"w": [1.0]})
        self.assertIn("pip install", str(cm.exception))
        self.assertEqual(p._c.calls, [])

    def test_published_twice(self):
        p = _publisher()
        p._state_dicts["model"] = object()
        with self.assertRaises(cuda_ipc.InvalidInput) as cm:
            p.publish_state_dict("model", {"w": object()})
        self.assertIn("update_state_dict", str(cm.exception))

    def test_update_of_an_unknown_set(self):
        p = _publisher()
        with self.assertRaises(cuda_ipc.InvalidInput) as cm:
            p.update_state_dict("model")
        self.assertIn("publish_state_dict", str(cm.exception))

    def test_update_with_other_keys(self):
        p = _publisher()
        p._state_dicts["model"] = sets._PublishedStateDict({"a": None, "b": None}, [])
        with self.assertRaises(cuda_ipc.InvalidInput) as cm:
            p.update_state_dict("model", {"a": object(), "c": object()})
        msg = str(cm.exception)
        self.assertIn("missing ['b']", msg)
        self.assertIn("unknown ['c']", msg)
        self.assertEqual(p._c.calls, [])

    def test_publish_set_members(self):
        p = _publisher()
        with self.assertRaises(cuda_ipc.InvalidInput) as cm:
            p.publish_set("s", [("w", None, "f32")])
        self.assertIn("(name, buffer, dtype, shape)", str(cm.exception))
        with self.assertRaises(cuda_ipc.InvalidInput) as cm:
            p.publish_set("s", [("w", None, "complex32", [4])])
        self.assertIn("unknown dtype 'complex32'", str(cm.exception))
        self.assertEqual(p._c.calls, [])
        p.publish_set("s", [("w", None, "torch.bfloat16", (2, 3))])
        self.assertEqual(p._c.calls, [("publish_set", ("s", [("w", None, "bf16", [2, 3], 0)], None))])
        self.assertIn("s", p._sets)

    def test_publish_set_members_at_an_offset(self):
        p = _publisher()
        p.publish_set("s", [("w", None, "f32", [4], 512)])
        self.assertEqual(p._c.calls, [("publish_set", ("s", [("w", None, "f32", [4], 512)], None))])
        for bad, text in (([("w", None, "f32", [4], -4)], "negative"),
                          ([("w", None, "f32", [4], 0, 1)], "(name, buffer, dtype, shape, offset)"),
                          ([("w", None, "f32", [4], "x")], "(name, buffer, dtype, shape, offset)")):
            with self.subTest(bad=bad):
                with self.assertRaises(cuda_ipc.InvalidInput) as cm:
                    p.publish_set("t", bad)
                self.assertIn(text, str(cm.exception))

    def test_the_copy_warning_says_how_to_avoid_it(self):
        msg = sets.copy_warning("model", 3, 3 * 2**20, "fc.weight")
        self.assertIn("copied 3 tensors (3.0 MiB, e.g. 'fc.weight')", msg)
        self.assertIn("cuda_ipc.torch.shareable(publisher)", msg)
        self.assertIn("update_state_dict", msg)

    def test_unpublish_goes_to_the_set(self):
        p = _publisher()
        p._sets.add("s")
        p._state_dicts["s"] = object()
        p.unpublish("s", timeout=1.5)
        p.unpublish("b")
        self.assertEqual(p._c.calls, [("unpublish_set", ("s", 1.5)), ("unpublish", ("b", None))])
        self.assertEqual((p._sets, p._state_dicts), (set(), {}))


class _Untouchable:
    """A published tensor (or a mapping of them) that fails the test if
    anything looks at it: an update without a state dict must not."""

    def __getattr__(self, name):
        raise AssertionError(f"an update looked at a tensor ({name})")

    def __getitem__(self, key):
        raise AssertionError(f"an update looked up tensor {key!r}")

    def __iter__(self):
        raise AssertionError("an update walked the tensors")

    def __len__(self):
        raise AssertionError("an update counted the tensors")


class UpdatesCostOneCall(unittest.TestCase):
    """An update without a state dict, and a wait for one, are one call
    into the extension each (which waits without the GIL), whatever the
    number of tensors: no Python loop, no tensor looked at."""

    def test_update_state_dict_without_a_state_dict(self):
        p = _publisher()
        p._state_dicts["model"] = sets._PublishedStateDict(_Untouchable(), _Untouchable())
        p.update_state_dict("model")
        p.update_state_dict("model", None)
        # No torch loaded: no PyTorch stream can hold writes, so the update
        # is ordered after the whole device (no stream handle).
        self.assertEqual(p._c.calls, [("update_set", ("model", None))] * 2)

    def test_wait_update_of_a_state_dict_and_of_a_set(self):
        class Core:
            calls = []

            def wait_update(self, timeout):
                self.calls.append(("wait_update", timeout))
                return 4

            def __getattr__(self, name):
                raise AssertionError(f"a wait looked at the set ({name})")

        core = Core()
        a = sets.SetAttachment(core)
        sd = sets.StateDict(a, {})
        # Tensors the wait must not touch (a dict's own storage is not
        # reachable through Python attribute access, so a stand-in value).
        dict.__setitem__(sd, "w", _Untouchable())
        self.assertEqual(sd.wait_update(1.5), 4)
        self.assertEqual(a.wait_update(), 4)
        self.assertEqual(core.calls, [("wait_update", 1.5), ("wait_update", None)])


class _StubSet:
    """Stands in for a SetAttachment: release fails while views are held."""

    name, lease = "model", 7

    def __init__(self):
        self.held = []
        self.calls = []

    def wait_update(self, timeout=None):
        self.calls.append(("wait_update", timeout))
        return 3

    def release(self):
        self.calls.append(("release", len(self.held)))
        if self.held:
            raise cuda_ipc.InvalidInput("still held")

    def __exit__(self, *exc):
        self.calls.append(("exit",))
        return False


class StateDictObject(unittest.TestCase):
    def test_is_a_dict_with_the_lease(self):
        a = _StubSet()
        sd = sets.StateDict(a, {"w": 1, "b": 2})
        self.assertIsInstance(sd, dict)
        self.assertEqual(dict(sd), {"w": 1, "b": 2})
        self.assertEqual((sd.name, sd.lease), ("model", 7))
        self.assertEqual(sd.wait_update(2.5), 3)
        self.assertEqual(a.calls, [("wait_update", 2.5)])

    def test_release_drops_its_tensors_first(self):
        a = _StubSet()
        sd = sets.StateDict(a, {"w": 1})
        sd.release()
        self.assertEqual(len(sd), 0)
        self.assertEqual(a.calls, [("release", 0)])

    def test_release_while_a_model_holds_tensors(self):
        a = _StubSet()
        a.held.append("a model's parameter")
        sd = sets.StateDict(a, {"w": 1})
        with self.assertRaises(cuda_ipc.InvalidInput):
            sd.release()
        self.assertEqual(len(sd), 0)

    def test_with_block(self):
        a = _StubSet()
        with sets.StateDict(a, {"w": 1}) as sd:
            self.assertEqual(sd["w"], 1)
        self.assertEqual(len(sd), 0)
        self.assertEqual(a.calls, [("exit",)])


class NoDriver(unittest.TestCase):
    """The set API without the driver: the class every entry point raises,
    with a message that says what to do."""

    CODE = r"""
import json, cuda_ipc
path = "/tmp/cuda-ipc-no-driver-sets.sock"
calls = {
    "publish_state_dict": lambda: cuda_ipc.Publisher(path).publish_state_dict("m", {"w": None}),
    "alloc": lambda: cuda_ipc.Publisher(path).alloc(4096),
    "attach_state_dict": lambda: cuda_ipc.Subscriber(path).attach_state_dict("m"),
    "attach_set": lambda: cuda_ipc.Subscriber(path).attach_set("m"),
}
out = {}
for name, fn in calls.items():
    try:
        fn()
        out[name] = "no error"
    except cuda_ipc.DriverNotFound as e:
        out[name] = str(e)
    except Exception as e:
        out[name] = "%s: %s" % (type(e).__name__, e)
print(json.dumps(out))
"""

    def test_every_entry_point(self):
        env = dict(os.environ, CUDA_IPC_DISABLE_DRIVER="1")
        r = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, %r)\n" % _path.PACKAGE_PARENT
                            + self.CODE], capture_output=True, text=True, timeout=60, env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        for name, message in json.loads(r.stdout).items():
            with self.subTest(call=name):
                self.assertIn("CUDA_IPC_DISABLE_DRIVER is set", message)


if __name__ == "__main__":
    unittest.main()
