"""The DLPack C exchange API path without a GPU or torch: a stand-in
``DLPackExchangeAPI`` built with ctypes (its functions Python callbacks)
checks how the extension decodes the capsule (name, versions, null
functions), reads tensors (shape, strides, dtype, device, bad structures),
makes tensors (the fields it hands over, and who frees the owner when the
framework succeeds, fails, or fails after calling the deleter), and how
the package chooses between this path and the Python one."""

import ctypes
import os
import sys
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402

import cuda_ipc  # noqa: E402
from cuda_ipc import _core, _torch_c  # noqa: E402


class Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class Header(ctypes.Structure):
    pass


Header._fields_ = [("version", Version), ("prev_api", ctypes.POINTER(Header))]


class Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", Device), ("ndim", ctypes.c_int32), ("dtype", DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class Managed(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(Managed))
Managed._fields_ = [("version", Version), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER),
                    ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]

FROM_MANAGED = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.POINTER(Managed)))
TO_PY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Managed), ctypes.POINTER(ctypes.c_void_p))
FROM_DLTENSOR = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(DLTensor))


class API(ctypes.Structure):
    _fields_ = [("header", Header), ("allocator", ctypes.c_void_p), ("from_managed", FROM_MANAGED),
                ("to_py", TO_PY), ("from_dltensor", FROM_DLTENSOR), ("stream", ctypes.c_void_p)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_incref = ctypes.pythonapi.Py_IncRef
_incref.argtypes = [ctypes.py_object]


class FakeTensor:
    """What the stand-in API describes: a tensor's fields, as ctypes keeps them."""

    def __init__(self, data=0x7000, shape=(2, 3), strides=(3, 1), dtype=(2, 32, 1), device=(2, 0),
                 byte_offset=0, ndim=None):
        self.shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * max(len(strides), 1))(*strides)
        self.fields = dict(data=data, ndim=len(shape) if ndim is None else ndim, dtype=dtype, device=device,
                           byte_offset=byte_offset)

    def fill(self, out):
        f = self.fields
        out.data = f["data"]
        out.device = Device(*f["device"])
        out.ndim = f["ndim"]
        out.dtype = DataType(*f["dtype"])
        out.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        out.strides = (ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64)) if self.strides is not None
                       else ctypes.POINTER(ctypes.c_int64)())
        out.byte_offset = f["byte_offset"]


class Made:
    """What the stand-in's to_py returns: the fields it was handed, and the
    managed tensor, whose deleter ``release`` calls."""

    def __init__(self, managed):
        m = managed.contents
        t = m.dl_tensor
        self.version = (m.version.major, m.version.minor)
        self.flags = m.flags
        self.data = t.data
        self.device = (t.device.device_type, t.device.device_id)
        self.dtype = (t.dtype.code, t.dtype.bits, t.dtype.lanes)
        self.shape = [t.shape[i] for i in range(t.ndim)]
        self.strides = [t.strides[i] for i in range(t.ndim)]
        self.managed = managed

    def release(self):
        m, self.managed = self.managed, None
        if m is not None:
            m.contents.deleter(m)


class StandIn:
    """A DLPackExchangeAPI whose functions are the methods below.
    ``to_py_mode``: "ok", "fail" (no tensor, the deleter not called) or
    "fail_after_delete" (no tensor, the deleter called)."""

    def __init__(self, version=(1, 3), prev=None, dltensor=True, managed=True, to_py=True, name=b"dlpack_exchange_api"):
        self.to_py_mode = "ok"
        self.deleted = 0
        self.fail_read = False
        self._keep = []
        self._delete = DELETER(self._deleter)
        self.api = API()
        self.api.header.version = Version(*version)
        if prev is not None:
            self.api.header.prev_api = ctypes.cast(ctypes.pointer(prev.api), ctypes.POINTER(Header))
        self._prev = prev
        self._cbs = (FROM_MANAGED(self._from_managed), TO_PY(self._to_py), FROM_DLTENSOR(self._from_dltensor))
        if managed:
            self.api.from_managed = self._cbs[0]
        if to_py:
            self.api.to_py = self._cbs[1]
        if dltensor:
            self.api.from_dltensor = self._cbs[2]
        self.capsule = _new_capsule(ctypes.addressof(self.api), name, None)

    def _from_dltensor(self, obj, out):
        if self.fail_read:
            return -1
        ctypes.cast(obj, ctypes.py_object).value.fill(out.contents)
        return 0

    def _from_managed(self, obj, out):
        if self.fail_read:
            return -1
        m = Managed()
        ctypes.cast(obj, ctypes.py_object).value.fill(m.dl_tensor)
        m.deleter = self._delete
        self._keep.append(m)
        out[0] = ctypes.pointer(m)
        return 0

    def _deleter(self, m):
        self.deleted += 1

    def _to_py(self, managed, out):
        if self.to_py_mode == "ok":
            made = Made(managed)
            _incref(made)  # the new reference the caller owns
            out[0] = id(made)
            return 0
        if self.to_py_mode == "fail_after_delete":
            managed.contents.deleter(managed)
        return -1


def _has_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def exchange(stand_in):
    return _core.TorchExchange(stand_in.capsule, FakeTensor)


class Capsule(unittest.TestCase):
    def test_the_struct_is_dlpack_1_3s(self):
        self.assertEqual(_core.DLPACK_EXCHANGE_API_SIZE, ctypes.sizeof(API))
        self.assertEqual(ctypes.sizeof(API), 56)

    def test_a_good_one(self):
        self.assertEqual(exchange(StandIn()).version, (1, 3))
        self.assertEqual(exchange(StandIn(version=(1, 7))).version, (1, 7))
        # Only one way to read a tensor is enough.
        exchange(StandIn(dltensor=False))
        exchange(StandIn(managed=False))

    def test_a_later_major_version_is_read_through_its_chain(self):
        old = StandIn()
        self.assertEqual(exchange(StandIn(version=(2, 0), prev=old)).version, (1, 3))

    def test_refused_with_what_is_wrong(self):
        cases = {
            "version 1.2": (StandIn(version=(1, 2)), "1.2"),
            "version 0.8": (StandIn(version=(0, 8)), "0.8"),
            "version 2 alone": (StandIn(version=(2, 0)), "2.0"),
            "no to_py": (StandIn(to_py=False), "managed_tensor_to_py_object_no_sync is null"),
            "no reader": (StandIn(dltensor=False, managed=False), "are null"),
            "another capsule": (StandIn(name=b"dltensor"), "dlpack_exchange_api"),
        }
        for what, (s, text) in cases.items():
            with self.subTest(what):
                with self.assertRaises(cuda_ipc.InvalidInput) as cm:
                    exchange(s)
                self.assertIn(text, str(cm.exception))
        with self.assertRaises(cuda_ipc.InvalidInput):
            _core.TorchExchange(12345, FakeTensor)


class Read(unittest.TestCase):
    def test_fields(self):
        for dltensor in (True, False):
            with self.subTest(dltensor=dltensor):
                s = StandIn(dltensor=dltensor)
                ex = exchange(s)
                t = FakeTensor(data=0x10000, shape=(4, 5, 6), strides=(1, 4, 20), dtype=(4, 16, 1),
                               device=(2, 1), byte_offset=512)
                self.assertEqual(ex.read_tensor(t),
                                 (0x10200, (2, 1), (4, 16, 1), [4, 5, 6], [1, 4, 20]))
                # The managed path hands the tensor back once.
                self.assertEqual(s.deleted, 0 if dltensor else 1)

    def test_no_strides_means_contiguous_and_0d(self):
        ex = exchange(StandIn())
        self.assertEqual(ex.read_tensor(FakeTensor(shape=(2, 3, 4), strides=None))[4], [12, 4, 1])
        self.assertEqual(ex.read_tensor(FakeTensor(shape=(), strides=()))[3:], ([], []))

    def test_bad_structures_are_errors(self):
        ex = exchange(StandIn())
        for what, t, text in (("ndim 65", FakeTensor(ndim=65), "ndim 65"),
                              ("ndim -1", FakeTensor(ndim=-1), "ndim -1"),
                              ("a negative dimension", FakeTensor(shape=(2, -3)), "negative dimension")):
            with self.subTest(what):
                with self.assertRaises(cuda_ipc.InvalidInput) as cm:
                    ex.read_tensor(t)
                self.assertIn(text, str(cm.exception))

    def test_another_type_is_refused_before_any_call(self):
        with self.assertRaises(cuda_ipc.InvalidInput) as cm:
            exchange(StandIn()).read_tensor([1, 2])
        self.assertIn("expected a FakeTensor, not list", str(cm.exception))

    def test_a_failing_reader_is_an_error(self):
        s = StandIn()
        s.fail_read = True
        with self.assertRaises(cuda_ipc.InvalidInput) as cm:
            exchange(s).read_tensor(FakeTensor())
        self.assertIn("could not describe the tensor", str(cm.exception))
        self.assertIn(_torch_c.ENV + "=0", str(cm.exception))


class Make(unittest.TestCase):
    def test_fields_and_ownership(self):
        s = StandIn()
        ex = exchange(s)
        before = _core.torch_c_owners()
        made = ex.probe_make(0xABC00, 3, "f32", [4, 5], [5, 1])
        self.assertIsInstance(made, Made)
        self.assertEqual((made.version, made.flags, made.data, made.device, made.dtype, made.shape, made.strides),
                         ((1, 3), 0, 0xABC00, (2, 3), (2, 32, 1), [4, 5], [5, 1]))
        self.assertEqual(_core.torch_c_owners(), before + 1)
        made.release()
        self.assertEqual(_core.torch_c_owners(), before)

    def test_dtypes_as_dlpack_codes(self):
        ex = exchange(StandIn())
        for name, want in (("bool", (6, 8, 1)), ("bf16", (4, 16, 1)), ("c128", (5, 128, 1)), ("u16", (1, 16, 1)),
                           ("i8", (0, 8, 1)), ("f16", (2, 16, 1))):
            with self.subTest(name):
                made = ex.probe_make(0x1000, 0, name, [], [])
                self.assertEqual(made.dtype, want)
                made.release()

    def test_a_failure_frees_the_owner_once(self):
        for mode in ("fail", "fail_after_delete"):
            with self.subTest(mode):
                s = StandIn()
                s.to_py_mode = mode
                before = _core.torch_c_owners()
                with self.assertRaises(cuda_ipc.InvalidInput) as cm:
                    exchange(s).probe_make(0x1000, 0, "f32", [2], [1])
                self.assertIn("could not make the tensor", str(cm.exception))
                self.assertEqual(_core.torch_c_owners(), before)

    def test_bad_layouts_are_refused_before_any_call(self):
        s = StandIn()
        s.to_py_mode = "fail"  # would raise another message if called
        ex = exchange(s)
        for shape, strides in (([2, 3], [1]), ([1] * 65, [1] * 65)):
            with self.subTest(ndim=len(shape)):
                with self.assertRaises(cuda_ipc.InvalidInput) as cm:
                    ex.probe_make(0x1000, 0, "f32", shape, strides)
                self.assertIn("at most 64 dimensions", str(cm.exception))
        with self.assertRaises(cuda_ipc.InvalidInput):
            ex.probe_make(0x1000, 0, "complex32", [2], [1])


class Choice(unittest.TestCase):
    def test_without_the_attribute_the_python_path(self):
        fake = types.SimpleNamespace(Tensor=type("Tensor", (), {}))
        ex, why = _torch_c.choose(fake, env={})
        self.assertIsNone(ex)
        self.assertIn("2.10", why)

    def test_with_the_attribute_the_c_api(self):
        s = StandIn()
        fake = types.SimpleNamespace(Tensor=type("Tensor", (), {"__dlpack_c_exchange_api__": s.capsule}))
        ex, why = _torch_c.choose(fake, env={})
        self.assertIsInstance(ex, _core.TorchExchange)
        self.assertIsNone(why)

    def test_the_environment_forces_the_python_path(self):
        s = StandIn()
        fake = types.SimpleNamespace(Tensor=type("Tensor", (), {"__dlpack_c_exchange_api__": s.capsule}))
        ex, why = _torch_c.choose(fake, env={_torch_c.ENV: "0"})
        self.assertIsNone(ex)
        self.assertIn(_torch_c.ENV, why)

    def test_an_unreadable_capsule_means_the_python_path(self):
        s = StandIn(version=(1, 2))
        fake = types.SimpleNamespace(Tensor=type("Tensor", (), {"__dlpack_c_exchange_api__": s.capsule}))
        ex, why = _torch_c.choose(fake, env={})
        self.assertIsNone(ex)
        self.assertIn("not usable", why)

    @unittest.skipIf(_has_torch(), "torch is installed here")
    def test_status_without_torch(self):
        saved = _torch_c._use(None)
        _torch_c._restore(None)  # not chosen yet
        try:
            self.assertEqual(_torch_c.status(), (False, "torch is not installed"))
            self.assertIsNone(_torch_c.exchange())
        finally:
            _torch_c._restore(saved)

    def test_a_test_can_force_either_path(self):
        saved = _torch_c._use(None, "forced")
        try:
            self.assertEqual(_torch_c.status(), (False, "forced"))
            self.assertIsNone(_torch_c.exchange())
        finally:
            _torch_c._restore(saved)


if __name__ == "__main__":
    unittest.main()
