"""export_torch's ``allow_fd`` without a GPU or torch (the exporter and the
tensor stood in for): the flag reaches the Rust exporter, which refuses
memory shared by file descriptors without it, and a tensor spanning
several expandable segments shared by file descriptors is refused with
``allow_fd=False`` before this process lets anyone take its descriptors."""

import types
import unittest
import warnings
from unittest import mock

import _path  # noqa: F401

import cuda_ipc  # noqa: E402
from cuda_ipc import export as _export  # noqa: E402


class StandInCore:
    """The calls export_torch makes to the extension, noted."""

    def __init__(self, fail=None):
        self.exports = []
        self.fd_fetching_allowed = 0
        self.fail = fail

    def dtype_from_torch(self, name):
        return name

    def export_memory(self, *args, **kwargs):
        self.exports.append(kwargs)
        if self.fail is not None:
            raise self.fail
        return types.SimpleNamespace(descriptor={"mechanism": "legacy"}, close=lambda: None)

    def allow_fd_fetching(self):
        self.fd_fetching_allowed += 1


class StandInTensor:
    device = types.SimpleNamespace(type="cuda", index=0)
    dtype = "torch.float32"
    shape = (4,)

    def detach(self):
        return self

    def data_ptr(self):
        return 0x7F0000000000

    def stride(self):
        return (1,)


def stand_ins(core, storage=None):
    """Patches of the export module: `core` for the extension, no torch."""
    patches = [
        mock.patch.object(_export, "_core", core),
        mock.patch.object(_export, "_require_torch_cuda", lambda t: object()),
        mock.patch.object(_export, "_event_torch", lambda torch, dev, stream: (None, b"\0" * 64)),
    ]
    if storage is not None:
        patches.append(mock.patch.object(_export, "_record",
                                         lambda t, ev=None: (t, {"torch_share": 1}, storage)))
    return patches


class AllowFd(unittest.TestCase):
    def run_with(self, core, storage=None, **kwargs):
        patches = stand_ins(core, storage)
        for p in patches:
            p.start()
        try:
            return cuda_ipc.export_torch(StandInTensor(), **kwargs)
        finally:
            for p in reversed(patches):
                p.stop()

    def test_the_flag_reaches_the_exporter(self):
        for kwargs, want in (({}, True), ({"allow_fd": True}, True), ({"allow_fd": False}, False)):
            with self.subTest(**kwargs):
                core = StandInCore()
                e = self.run_with(core, **kwargs)
                self.assertEqual(e.kind, "descriptor")
                self.assertEqual(len(core.exports), 1)
                self.assertIs(core.exports[0].get("allow_fd"), want, core.exports[0])

    def test_several_fd_segments_are_refused_without_allow_fd(self):
        storage = {"type": "e", "handles": [3, 4], "kind": "fd"}
        core = StandInCore(fail=cuda_ipc.CudaIpcError("the range spans two allocations"))
        with self.assertRaises(cuda_ipc.Unsupported) as cm:
            self.run_with(core, storage, allow_fd=False)
        self.assertIn("allow_fd=True", str(cm.exception))
        self.assertEqual(core.fd_fetching_allowed, 0, "ptrace was widened although allow_fd=False")

    def test_several_fd_segments_with_allow_fd_are_a_share_record(self):
        storage = {"type": "e", "handles": [3, 4], "kind": "fd"}
        core = StandInCore(fail=cuda_ipc.CudaIpcError("the range spans two allocations"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            e = self.run_with(core, storage, allow_fd=True)
        self.assertEqual(e.kind, "torch_share")
        self.assertEqual(core.fd_fetching_allowed, 1)
        self.assertTrue(any("share record" in str(w.message) for w in caught))

    def test_the_exporter_takes_the_flag_and_refuses_fd_memory_by_default(self):
        sig = getattr(cuda_ipc._core.export_memory, "__text_signature__", "") or ""
        self.assertIn("allow_fd=False", sig)


if __name__ == "__main__":
    unittest.main()
