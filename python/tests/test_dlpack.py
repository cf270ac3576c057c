"""The DLPack capsule's destructor without a GPU, on probe capsules that the
extension makes and destroys exactly as it does the capsules of mapped
memory: a capsule nobody consumed frees its tensor once, a consumed one
(renamed "used_dltensor", as consumers do) is left to its consumer, and
neither erases an exception that is in flight while the capsule is
collected."""

import ctypes
import gc
import unittest

import _path  # noqa: F401

from cuda_ipc import _core  # noqa: E402

_set_name = ctypes.pythonapi.PyCapsule_SetName
_set_name.restype = ctypes.c_int
_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class CapsuleDestructor(unittest.TestCase):
    def test_a_capsule_nobody_took_frees_its_tensor_once(self):
        before = _core._dlpack_probes_freed()
        capsule = _core._dlpack_probe()
        self.assertTrue(_get_pointer(capsule, b"dltensor"))
        del capsule
        gc.collect()
        self.assertEqual(_core._dlpack_probes_freed(), before + 1)

    def test_a_consumed_capsule_is_left_to_its_consumer(self):
        before = _core._dlpack_probes_freed()
        capsule = _core._dlpack_probe()
        self.assertEqual(_set_name(capsule, b"used_dltensor"), 0)
        del capsule
        gc.collect()
        self.assertEqual(
            _core._dlpack_probes_freed(),
            before,
            "the destructor freed a tensor its consumer owns",
        )

    def test_an_exception_in_flight_survives_a_consumed_capsule(self):
        before = _core._dlpack_probes_freed()
        self.assertTrue(
            _core._dlpack_probe_dropped_in_flight(True),
            "collecting a consumed capsule erased the exception in flight",
        )
        self.assertEqual(_core._dlpack_probes_freed(), before)

    def test_an_exception_in_flight_survives_an_unconsumed_capsule(self):
        before = _core._dlpack_probes_freed()
        self.assertTrue(
            _core._dlpack_probe_dropped_in_flight(False),
            "collecting an unconsumed capsule erased the exception in flight",
        )
        self.assertEqual(_core._dlpack_probes_freed(), before + 1)

if __name__ == "__main__":
    unittest.main()
