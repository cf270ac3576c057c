"""What publishes and updates are ordered after (cuda_ipc.streams): the
stream arguments read, and the handles the publisher's calls pass to the
extension. No GPU, no torch: a stand-in core records the calls, and a
stand-in torch module gives a current stream."""

import sys
import types
import unittest

import _path  # noqa: E402,F401

import cuda_ipc  # noqa: E402
from cuda_ipc import sets, streams  # noqa: E402
from test_state_dict import _publisher, _StubCore, _Untouchable  # noqa: E402


class _TorchStream:
    def __init__(self, handle):
        self.cuda_stream = handle


class _CupyStream:
    def __init__(self, handle):
        self.ptr = handle


class _ProtocolStream:
    def __init__(self, got):
        self.got = got

    def __cuda_stream__(self):
        return self.got


class StreamHandles(unittest.TestCase):
    def test_the_forms_a_stream_takes(self):
        self.assertIsNone(streams.stream_handle(None))
        self.assertEqual(streams.stream_handle(0), 0)
        self.assertEqual(streams.stream_handle(0x7F00_1234), 0x7F00_1234)
        self.assertEqual(streams.stream_handle(2**64 - 1), 2**64 - 1)
        self.assertEqual(streams.stream_handle(_TorchStream(0x55)), 0x55)
        self.assertEqual(streams.stream_handle(_CupyStream(0x66)), 0x66)
        self.assertEqual(streams.stream_handle(_ProtocolStream((0, 0x77))), 0x77)

    def test_what_is_not_a_stream(self):
        cases = {
            "a bool": (True, "not True"),
            "negative": (-1, "not a pointer"),
            "too large": (2**64, "not a pointer"),
            "a float": (1.5, "not float"),
            "a string": ("0x10", "not str"),
            "no handle attribute": (object(), "not object"),
            "a handle attribute of the wrong type": (_TorchStream("7"), "not _TorchStream"),
            "a protocol giving one int": (_ProtocolStream(5), "not (version, handle)"),
            "a protocol giving three": (_ProtocolStream((0, 1, 2)), "not (version, handle)"),
            "a protocol giving a bool": (_ProtocolStream((0, False)), "not (version, handle)"),
            "a protocol handle that is negative": (_ProtocolStream((0, -3)), "not a pointer"),
        }
        for what, (stream, text) in cases.items():
            with self.subTest(what):
                with self.assertRaises(cuda_ipc.InvalidInput) as cm:
                    streams.stream_handle(stream)
                self.assertIn(text, str(cm.exception))


def _fake_torch(current):
    """A module standing in for torch: its current stream on device d is
    ``current + d``; it records the devices asked for."""
    asked = []

    def raw(device):
        asked.append(device)
        return current + device

    torch = types.ModuleType("torch")
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=raw)
    return torch, asked


class PublisherCallsPassTheStream(unittest.TestCase):
    def test_sets_pass_the_stream_given(self):
        p = _publisher()
        p.publish_set("s", [("w", None, "f32", [4])], stream=_TorchStream(0x51))
        p.update_set("s", stream=_CupyStream(0x52))
        p.update_set("s")
        p.update_set("s", 0)
        self.assertEqual(p._c.calls, [
            ("publish_set", ("s", [("w", None, "f32", [4], 0)], 0x51)),
            ("update_set", ("s", 0x52)),
            ("update_set", ("s", None)),
            ("update_set", ("s", 0)),
        ])

    def test_a_buffer_update_and_a_ring_frame_pass_the_stream_given(self):
        p = _publisher()
        p.update("x")
        p.update("x", stream=_ProtocolStream((0, 0x53)))
        p.update("x", 0)
        self.assertEqual(p._c.calls, [
            ("update", ("x", None)),
            ("update", ("x", 0x53)),
            ("update", ("x", 0)),
        ])
        ring = cuda_ipc.RingPublisher(_StubCore(), 0)
        ring.publish(2)
        ring.publish(1, {"i": 7}, stream=_TorchStream(0x54))
        self.assertEqual(ring._c.calls, [
            ("publish", (2, None, None)),
            ("publish", (1, {"i": 7}, 0x54)),
        ])

    def test_a_bad_stream_calls_nothing(self):
        p = _publisher()
        with self.assertRaises(cuda_ipc.InvalidInput):
            p.publish_set("s", [("w", None, "f32", [4])], stream="default")
        with self.assertRaises(cuda_ipc.InvalidInput):
            p.update_set("s", stream=-1)
        with self.assertRaises(cuda_ipc.InvalidInput):
            p.update("x", stream=1.5)
        ring = cuda_ipc.RingPublisher(_StubCore(), 0)
        with self.assertRaises(cuda_ipc.InvalidInput):
            ring.publish(0, stream=object())
        self.assertEqual(p._c.calls, [])
        self.assertEqual(ring._c.calls, [])
        self.assertNotIn("s", p._sets)

    def test_a_state_dict_update_follows_torchs_current_stream(self):
        torch, asked = _fake_torch(0x9000)
        old = sys.modules.get("torch")
        sys.modules["torch"] = torch
        try:
            p = _publisher()
            p._c.device = 3
            p._state_dicts["model"] = sets._PublishedStateDict(_Untouchable(), _Untouchable())
            p.update_state_dict("model")
        finally:
            if old is None:
                del sys.modules["torch"]
            else:
                sys.modules["torch"] = old
        self.assertEqual(asked, [3])
        self.assertEqual(p._c.calls, [("update_set", ("model", 0x9003))])

    def test_a_state_dict_update_without_torch_loaded_waits_for_the_device(self):
        old = sys.modules.pop("torch", None)
        try:
            p = _publisher()
            p._state_dicts["model"] = sets._PublishedStateDict(_Untouchable(), _Untouchable())
            p.update_state_dict("model")
        finally:
            if old is not None:
                sys.modules["torch"] = old
        self.assertEqual(p._c.calls, [("update_set", ("model", None))])

    def test_the_current_stream_function_follows_the_torch_module(self):
        # Looked up once per module: another torch module (a test's stand-in,
        # a reload) is asked, not the one seen first.
        first, asked_first = _fake_torch(0x1000)
        second, asked_second = _fake_torch(0x2000)
        old = sys.modules.get("torch")
        try:
            handles = []
            for torch in (first, first, second, first):
                sys.modules["torch"] = torch
                handles.append(streams.torch_current_if_loaded(1))
        finally:
            if old is None:
                del sys.modules["torch"]
            else:
                sys.modules["torch"] = old
        self.assertEqual(handles, [0x1001, 0x1001, 0x2001, 0x1001])
        self.assertEqual((asked_first, asked_second), ([1, 1, 1], [1]))

    def test_a_torch_without_the_raw_stream_call_goes_through_current_stream(self):
        torch = types.ModuleType("torch")
        torch._C = types.SimpleNamespace()
        torch.cuda = types.SimpleNamespace(
            current_stream=lambda device: types.SimpleNamespace(cuda_stream=0x700 + device))
        self.assertEqual(streams.torch_current(torch, 2), 0x702)
        self.assertEqual(streams.torch_current(torch, 5), 0x705)


if __name__ == "__main__":
    unittest.main()
