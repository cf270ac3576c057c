"""The mapping logic of cuda_ipc.open against a fake driver: which driver
calls each mechanism makes, in which order they are undone, events, views
keeping a closed mapping alive, clean-up after a failure half-way. No GPU:
the driver and pidfd_getfd are replaced."""

import gc
import os
import struct
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402,F401

import cuda_ipc  # noqa: E402
from cuda_ipc import mapping as mapping_mod  # noqa: E402
from cuda_ipc.errors import DescriptorError, DriverError  # noqa: E402

UUID = "GPU-12345678-9abc-def0-0102-030405060708"
OTHER = "GPU-00000000-0000-0000-0000-000000000001"
MIB = 1 << 20


class FakeDriver:
    def __init__(self):
        self.log = []
        self.fail = None
        self.alloc_size = 2 * MIB
        self.next = 0x7F0000000000
        self.event_done = False

    def _c(self, name, *args):
        self.log.append((name,) + args)
        if self.fail == name:
            raise DriverError(name, 2, "CUDA_ERROR_OUT_OF_MEMORY")

    def device_count(self):
        return 2

    def ordinal_of(self, uuid):
        return {UUID.lower(): 1, OTHER.lower(): 0}.get(uuid.lower())

    def bound(self, ordinal):
        drv = self

        class B:
            def __enter__(self):
                drv.log.append(("push", ordinal))

            def __exit__(self, *exc):
                drv.log.append(("pop", ordinal))

        return B()

    def _addr(self):
        self.next += 0x10000000
        return self.next

    def ipc_open_mem_handle(self, handle):
        self._c("cuIpcOpenMemHandle", handle[:2])
        return self._addr()

    def address_range(self, ptr):
        self._c("cuMemGetAddressRange", ptr)
        return ptr, self.alloc_size

    def ipc_close_mem_handle(self, ptr):
        self._c("cuIpcCloseMemHandle", ptr)

    def import_fd(self, fd):
        os.fstat(fd)  # must still be open during the import
        self._c("cuMemImportFromShareableHandle", "fd")
        return 1000 + len(self.log)

    def import_fabric(self, h):
        self._c("cuMemImportFromShareableHandle", "fabric")
        return 2000 + len(self.log)

    def address_reserve(self, size):
        self._c("cuMemAddressReserve", size)
        return self._addr()

    def mem_map(self, ptr, size, h):
        self._c("cuMemMap", ptr, size, h)

    def mem_set_access(self, ptr, size, ordinal):
        self._c("cuMemSetAccess", ptr, size, ordinal)

    def mem_unmap(self, ptr, size):
        self._c("cuMemUnmap", ptr, size)

    def address_free(self, ptr, size):
        self._c("cuMemAddressFree", ptr, size)

    def mem_release(self, h):
        self._c("cuMemRelease", h)

    def pool_import_fd(self, fd):
        os.fstat(fd)
        self._c("cuMemPoolImportFromShareableHandle")
        return 0xAB

    def pool_ensure_access(self, pool, ordinal):
        self._c("cuMemPoolSetAccess", pool, ordinal)

    def pool_import_pointer(self, pool, data):
        self._c("cuMemPoolImportPointer", pool)
        return self._addr()

    def pool_destroy(self, pool):
        self._c("cuMemPoolDestroy", pool)

    def mem_free(self, ptr):
        self._c("cuMemFree", ptr)

    def ipc_open_event_handle(self, h):
        self._c("cuIpcOpenEventHandle")
        return 0xE0E0

    def event_destroy(self, e):
        self._c("cuEventDestroy", e)

    def event_complete(self, event):
        self._c("cuEventQuery", event)
        return self.event_done

    def stream_wait_event(self, stream, event):
        self._c("cuStreamWaitEvent", stream, event)

    def ctx_synchronize(self):
        self._c("cuCtxSynchronize")

    def names(self):
        return [c[0] for c in self.log if c[0] not in ("push", "pop")]


def desc(**kw):
    d = {"cuda_ipc": 1, "mechanism": "legacy", "handle": "cd" * 64, "alloc_size": 2 * MIB,
         "offset": 4096, "len": 1024, "dtype": "f32", "shape": [16, 16], "device_uuid": UUID, "pid": 77}
    d.update(kw)
    return {k: v for k, v in d.items() if v is not None}


class Base(unittest.TestCase):
    def setUp(self):
        self.fake = FakeDriver()
        self.taken = []
        self._saved = (mapping_mod.driver, mapping_mod._take_fd)
        mapping_mod.driver = lambda: self.fake
        r, w = os.pipe()
        self.pipe = (r, w)

        def take(pid, fd):
            mine = os.dup(r)
            self.taken.append((pid, fd, mine))
            return mine

        mapping_mod._take_fd = take

    def tearDown(self):
        mapping_mod.driver, mapping_mod._take_fd = self._saved
        for fd in self.pipe:
            os.close(fd)
        gc.collect()

    def assert_fds_closed(self):
        for _, _, fd in self.taken:
            with self.assertRaises(OSError, msg=f"fd {fd} left open"):
                os.fstat(fd)


class Mechanisms(Base):
    def test_legacy(self):
        m = cuda_ipc.open(desc())
        base = self.fake.next  # the only address handed out
        self.assertEqual(m.ptr, base + 4096)
        self.assertEqual(m.device, 1)
        self.assertEqual(m.shape, (16, 16))
        cai = m.__cuda_array_interface__
        self.assertEqual(cai["data"], (base + 4096, False))
        self.assertIsNone(cai["stream"])
        self.assertEqual(cuda_ipc.live_mappings(), 1)
        m.close()
        self.assertEqual(self.fake.names(), ["cuIpcOpenMemHandle", "cuMemGetAddressRange",
                                             "cuCtxSynchronize", "cuIpcCloseMemHandle"])
        self.assertEqual(cuda_ipc.live_mappings(), 0)
        self.assertTrue(m.closed)
        m.close()  # twice is fine
        with self.assertRaises(cuda_ipc.CudaIpcError):
            m.__cuda_array_interface__

    def test_event_is_waited_on_and_destroyed_first(self):
        m = cuda_ipc.open(desc(event="ee" * 64), stream=0x5000)
        self.assertIn(("cuStreamWaitEvent", 0x5000, 0xE0E0), self.fake.log)
        self.assertEqual(m.__cuda_array_interface__["stream"], 0x5000)
        m.close()
        names = self.fake.names()
        self.assertLess(names.index("cuEventDestroy"), names.index("cuIpcCloseMemHandle"))

    def test_a_completed_event_queues_no_wait(self):
        self.fake.event_done = True
        m = cuda_ipc.open(desc(event="ee" * 64), stream=0x5000)
        m.wait(0x77)
        self.assertIn(("cuEventQuery", 0xE0E0), self.fake.log)
        self.assertNotIn("cuStreamWaitEvent", self.fake.names())
        m.close()
        self.assertIn("cuEventDestroy", self.fake.names())

    def test_event_on_default_stream_reports_stream_1(self):
        m = cuda_ipc.open(desc(event="ee" * 64))
        self.assertIn(("cuStreamWaitEvent", 0, 0xE0E0), self.fake.log)
        self.assertEqual(m.__cuda_array_interface__["stream"], 1)
        m.wait(0x77)
        self.assertIn(("cuStreamWaitEvent", 0x77, 0xE0E0), self.fake.log)
        m.close()

    def test_vmm(self):
        m = cuda_ipc.open(desc(mechanism="vmm", handle=None, fd=12, offset=0))
        self.assertEqual(self.taken[0][:2], (77, 12))
        self.assert_fds_closed()
        m.close()
        self.assertEqual(self.fake.names(), [
            "cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess",
            "cuCtxSynchronize", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease"])
        reserve = [c for c in self.fake.log if c[0] == "cuMemAddressReserve"][0]
        self.assertEqual(reserve[1], 2 * MIB)

    def test_pool(self):
        m = cuda_ipc.open(desc(mechanism="pool", fd=5, handle="12" * 64))
        self.assert_fds_closed()
        m.close()
        self.assertEqual(self.fake.names(), [
            "cuMemPoolImportFromShareableHandle", "cuMemPoolSetAccess", "cuMemPoolImportPointer",
            "cuMemGetAddressRange", "cuCtxSynchronize", "cuMemFree", "cuMemPoolDestroy"])

    def test_fabric(self):
        m = cuda_ipc.open(desc(mechanism="fabric", offset=0))
        m.close()
        self.assertIn("cuMemImportFromShareableHandle", self.fake.names())
        self.assertEqual(self.taken, [])

    def test_device_override_and_unknown_uuid(self):
        m = cuda_ipc.open(desc(), device=0)
        self.assertEqual(m.device, 0)
        m.close()
        with self.assertRaisesRegex(cuda_ipc.CudaIpcError, "not visible"):
            cuda_ipc.open(desc(device_uuid="GPU-99999999-0000-0000-0000-000000000000"))
        with self.assertRaisesRegex(cuda_ipc.CudaIpcError, "not available"):
            cuda_ipc.open(desc(), device=5)

    def test_invalid_descriptor_never_reaches_the_driver(self):
        with self.assertRaises(DescriptorError):
            cuda_ipc.open(desc(len=3))
        with self.assertRaises(DescriptorError):
            cuda_ipc.open("not json")
        self.assertEqual(self.fake.log, [])


class Failures(Base):
    def test_failure_half_way_undoes_everything(self):
        self.fake.fail = "cuMemMap"
        with self.assertRaises(DriverError) as cm:
            cuda_ipc.open(desc(mechanism="vmm", handle=None, fd=12, offset=0))
        self.assertEqual(cm.exception.call, "cuMemMap")
        names = self.fake.names()
        self.assertEqual(names[-2:], ["cuMemAddressFree", "cuMemRelease"])
        self.assertEqual(cuda_ipc.live_mappings(), 0)
        self.assert_fds_closed()

    def test_range_past_the_allocation(self):
        self.fake.alloc_size = 4096
        with self.assertRaisesRegex(DescriptorError, "passes the end of the 4096-byte"):
            cuda_ipc.open(desc())
        self.assertEqual(self.fake.names()[-1], "cuIpcCloseMemHandle")


class Views(Base):
    def test_views_keep_a_closed_mapping(self):
        m = cuda_ipc.open(desc())
        v = m._view(raw=False)
        self.assertEqual(v.__cuda_array_interface__["shape"], (16, 16))
        m.close()
        self.assertNotIn("cuIpcCloseMemHandle", self.fake.names())
        self.assertEqual(cuda_ipc.live_mappings(), 1)
        del v
        gc.collect()
        self.assertIn("cuIpcCloseMemHandle", self.fake.names())
        self.assertEqual(cuda_ipc.live_mappings(), 0)

    def test_dropping_the_mapping_releases(self):
        cuda_ipc.open(desc())
        gc.collect()
        self.assertIn("cuIpcCloseMemHandle", self.fake.names())

    def test_view_outlives_dropped_mapping(self):
        v = cuda_ipc.open(desc())._view(raw=True)
        gc.collect()
        self.assertNotIn("cuIpcCloseMemHandle", self.fake.names())
        self.assertEqual(v.__cuda_array_interface__["typestr"], "<i4")
        del v
        gc.collect()
        self.assertIn("cuIpcCloseMemHandle", self.fake.names())

    def test_context_manager(self):
        with cuda_ipc.open(desc()) as m:
            self.assertFalse(m.closed)
        self.assertTrue(m.closed)

    def test_dtype_reinterpretation_rules(self):
        m = cuda_ipc.open(desc())
        self.assertEqual(m._target("int32").name, "i32")
        self.assertEqual(m._target(None).name, "f32")
        with self.assertRaisesRegex(cuda_ipc.CudaIpcError, "element sizes differ"):
            m._target("float64")
        with self.assertRaisesRegex(cuda_ipc.CudaIpcError, "unknown dtype"):
            m._target("complex64")
        m.close()


def segments(version, fds, pid=77, seg=2 * MIB):
    b = bytes([version]) + b"e" + struct.pack("<i4xQQ", pid, seg, len(fds))
    return b + b"".join(struct.pack("<i", f) for f in fds)


class TorchRecords(Base):
    def record(self, handle, **kw):
        r = {"torch_share": 1, "storage_handle": handle.hex(), "storage_size_bytes": 3 * MIB,
             "storage_offset_bytes": 1 * MIB, "tensor_size": [1024], "tensor_stride": [1],
             "tensor_offset": 256, "dtype": "float32", "storage_device": 0, "device_uuid": UUID,
             "pid": 77, "event_handle": "ee" * 64, "event_sync_required": True}
        r.update(kw)
        return r

    def test_multi_segment_record_maps_segments_back_to_back(self):
        m = cuda_ipc.open(self.record(segments(2, [30, 31, 32])))
        self.assertEqual([t[:2] for t in self.taken], [(77, 30), (77, 31), (77, 32)])
        self.assert_fds_closed()
        reserve = [c for c in self.fake.log if c[0] == "cuMemAddressReserve"][0]
        self.assertEqual(reserve[1], 6 * MIB)
        maps = [c for c in self.fake.log if c[0] == "cuMemMap"]
        base = maps[0][1]
        self.assertEqual([c[1] - base for c in maps], [0, 2 * MIB, 4 * MIB])
        self.assertEqual(m.ptr, base + MIB + 1024)
        self.assertEqual(m.segments, 3)
        self.assertEqual(m.mechanism, "torch_segments")
        self.assertIn("cuStreamWaitEvent", self.fake.names())
        m.close()
        self.assertEqual(self.fake.names().count("cuMemUnmap"), 3)
        self.assertEqual(self.fake.names().count("cuMemRelease"), 3)

    def test_c_record_is_a_legacy_open(self):
        m = cuda_ipc.open(self.record(bytes([2]) + b"c" + bytes(range(1, 65)), storage_offset_bytes=0,
                                      storage_size_bytes=8192))
        self.assertEqual(m.mechanism, "legacy")
        self.assertEqual(m.descriptor["offset"], 1024)
        m.close()


if __name__ == "__main__":
    unittest.main()
