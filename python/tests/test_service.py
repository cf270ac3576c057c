"""cuda_ipc.service without a GPU: argument checks before anything is
sent, layouts as the service takes them, and a missing service's error
(a CudaIpcError, never a crash)."""

import os
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402,F401

import cuda_ipc  # noqa: E402
from cuda_ipc import service  # noqa: E402
from cuda_ipc.errors import CudaIpcError, InvalidInput, PeerGone, ServiceError  # noqa: E402


class Arguments(unittest.TestCase):
    def test_bad_arguments_are_refused_before_anything_is_sent(self):
        for call in (
            lambda: service.ls(""),
            lambda: service.ls(5),
            lambda: service.stats(None),
            lambda: service.load("svc", ""),
            lambda: service.load("svc", "/m", set=""),
            lambda: service.load("svc", "/m", streams=0),
            lambda: service.load("svc", "/m", streams=True),
            lambda: service.load("svc", "/m", staging=-1),
            lambda: service.drop("svc", ""),
            lambda: service.drop("svc", "m", force="yes"),
            lambda: service.save("svc", ""),
            lambda: service.save("svc", "/s", overwrite="yes"),
            lambda: service.save("svc", "/s", streams=0),
            lambda: service.save("svc", "/s", staging=True),
            lambda: service.call("svc", "ls", [1]),
            lambda: service.call("svc", "", {}),
            lambda: service.Writer("svc", ""),
            lambda: service.Writer("svc", "m", layout={}),
            lambda: service.Writer("svc", "m", in_place="yes"),
            lambda: service.Writer("svc", "m", in_place=True, layout={"w": ("f32", (1,))}),
            lambda: service.Writer("svc", "m", in_place=True, wait=-1),
            lambda: service.Writer("svc", "m", in_place=True, wait=True),
            lambda: service.Reader("svc").attach_state_dict(""),
            lambda: service.Reader("svc", reconnect="yes"),
            lambda: service.Reader("svc", reconnect=1),
        ):
            with self.subTest(call=call):
                with self.assertRaises(CudaIpcError) as c:
                    call()
                # Argument checks come first: an InvalidInput (a missing
                # driver or service only for the Reader, which connects).
                if not isinstance(c.exception, InvalidInput):
                    self.assertIsInstance(c.exception, CudaIpcError)

    def test_a_bad_service_name_is_invalid_input(self):
        with self.assertRaises(InvalidInput):
            service.ls("bad name!")

    def test_layouts_are_given_as_the_service_takes_them(self):
        got = service._layout({"w": ("bf16", (2, 3)), "b": ("float32", [4])})
        self.assertEqual(got, [{"name": "w", "dtype": "bf16", "shape": [2, 3]},
                               {"name": "b", "dtype": "f32", "shape": [4]}])

        class FakeTensor:
            dtype = "torch.float16"
            shape = (5,)

        self.assertEqual(service._layout({"t": FakeTensor()}),
                         [{"name": "t", "dtype": "f16", "shape": [5]}])
        for bad in ({}, [("w", ("f32", [1]))], {"w": ("nope", [1])}, {"w": ("f32", [0])},
                    {"w": ("f32", 3)}, {"w": ("f32", [True])}, {"w": 5}, {"": ("f32", [1])}):
            with self.subTest(layout=bad):
                with self.assertRaises(InvalidInput):
                    service._layout(bad)


class TensorParallel(unittest.TestCase):
    def test_shard_names(self):
        self.assertEqual(service.shard_name("model", 3, 8), "model.tp3-of-8")
        self.assertEqual(service.shard_name("m", 0, 1), "m.tp0-of-1")
        self.assertEqual(service.shard_name("m", 63, 64), "m.tp63-of-64")
        self.assertIn("shard_name", service.__all__)
        for bad in (("m", 2, 2), ("m", -1, 2), ("m", 0, 0), ("m", 0, 65), ("", 0, 2),
                    ("m", True, 2), ("m", 0, 2.0), ("m", "0", 2), (None, 0, 2)):
            with self.subTest(args=bad):
                with self.assertRaises(InvalidInput):
                    service.shard_name(*bad)

    def _body(self, **kwargs):
        """The body load sends, without a service."""
        sent = []
        real = service.call
        service.call = lambda svc, method, body, **kw: sent.append((method, body)) or {}
        try:
            service.load("svc", "/m", **kwargs)
        finally:
            service.call = real
        self.assertEqual(sent[0][0], "load")
        return sent[0][1]

    def test_a_shard_s_load_sends_rank_world_and_rules(self):
        self.assertNotIn("tp", self._body())
        self.assertEqual(self._body(tp=(1, 4))["tp"], {"rank": 1, "world": 4})
        body = self._body(set="llama", tp=[7, 8], tp_rules=[("experts", 1), ("bias", None)])
        self.assertEqual(body["set"], "llama")
        self.assertEqual(body["tp"], {"rank": 7, "world": 8,
                                      "rules": [["experts", 1], ["bias", None]]})

    def test_bad_shards_and_rules_are_refused_before_anything_is_sent(self):
        for kwargs in ({"tp": (2, 2)}, {"tp": (0, 65)}, {"tp": 4}, {"tp": "0/2"},
                       {"tp": (0, 2, 1)}, {"tp": (0.0, 2)},
                       {"tp_rules": [("norm", None)]},
                       {"tp": (0, 2), "tp_rules": "norm=0"},
                       {"tp": (0, 2), "tp_rules": [("norm",)]},
                       {"tp": (0, 2), "tp_rules": [("", 0)]},
                       {"tp": (0, 2), "tp_rules": [("x" * 257, 0)]},
                       {"tp": (0, 2), "tp_rules": [("norm", -1)]},
                       {"tp": (0, 2), "tp_rules": [("norm", True)]},
                       {"tp": (0, 2), "tp_rules": [("norm", "1")]},
                       {"tp": (0, 2), "tp_rules": [("norm", 0)] * 65}):
            with self.subTest(kwargs=kwargs):
                with self.assertRaises(InvalidInput):
                    self._body(**kwargs)


class MissingService(unittest.TestCase):
    def test_a_missing_service_is_a_cuda_ipc_error_naming_it(self):
        name = f"no-such-service-{os.getpid()}"
        for call in (lambda: service.ls(name), lambda: service.stats(name),
                     lambda: service.drop(name, "m"), lambda: service.load(name, "/m")):
            with self.subTest(call=call):
                with self.assertRaises(CudaIpcError) as c:
                    call()
                self.assertNotIsInstance(c.exception, InvalidInput)
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(CudaIpcError) as c:
                service.ls(os.path.join(d, "svc.sock"))
            self.assertIn("svc.sock", str(c.exception))

    def test_a_reader_or_writer_of_a_missing_service_raises_a_cuda_ipc_error(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "svc.sock")
            with self.assertRaises(CudaIpcError):
                service.Reader(path)
            with self.assertRaises(CudaIpcError):
                with service.Writer(path, "m"):
                    pass


class _Core:
    """Stands in for the reader's subscriber: records what it is asked."""

    def __init__(self):
        self.asked = []

    def sleep(self, *, unchecked=False):
        self.asked.append(("sleep", unchecked))
        return (1, 2)

    def step_aside(self, name):
        self.asked.append(("step_aside", name))
        return {"set": name, "version": 3, "writing_in_place": False}

    def come_back(self, name, *, next=False, timeout=600.0):
        self.asked.append(("come_back", name, next, timeout))
        return {"set": name, "version": 4}

    def reconnect(self):
        self.asked.append(("reconnect",))
        return {"connected": True, "retaken": ["m"], "old_versions": [], "not_retaken": [],
                "chunks": 1, "chunks_unleased": 0}


class Reconnect(unittest.TestCase):
    def _reader(self):
        reader = service.Reader.__new__(service.Reader)
        reader.subscriber = _Core()
        return reader

    def test_a_reader_reconnects_through_the_core(self):
        reader = self._reader()
        done = reader.reconnect()
        self.assertEqual(done["retaken"], ["m"])
        self.assertEqual(reader.subscriber.asked, [("reconnect",)])

    def test_stepping_aside_sleeps_first_and_coming_back_goes_through_the_core(self):
        # The core keeps the aside for new connections and takes it back
        # at come_back: the reader calls it, not the service directly.
        reader = self._reader()
        self.assertEqual(reader.step_aside("m", unchecked=True)["version"], 3)
        self.assertEqual(reader.come_back("m", next=True, timeout=2.5)["version"], 4)
        self.assertEqual(reader.subscriber.asked,
                         [("sleep", True), ("step_aside", "m"), ("come_back", "m", True, 2.5)])
        for bad in (lambda: reader.come_back("m", timeout=-1),
                    lambda: reader.come_back("m", timeout=601),
                    lambda: reader.come_back("m", next="yes"),
                    lambda: reader.come_back(""),
                    lambda: reader.step_aside("")):
            with self.assertRaises(InvalidInput):
                bad()
        self.assertEqual(len(reader.subscriber.asked), 3, "refused before anything was asked")

    def test_a_missing_service_fails_at_once_whatever_reconnect_says(self):
        # Reconnecting is for a connection that ended, never for the first.
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "svc.sock")
            for reconnect in (None, True, False):
                with self.subTest(reconnect=reconnect):
                    started = time.monotonic()
                    with self.assertRaises(CudaIpcError):
                        service.Reader(path, reconnect=reconnect, timeout=3.0)
                    self.assertLess(time.monotonic() - started, 2.0)

    def test_the_subscriber_offers_reconnect(self):
        from cuda_ipc import channel

        for name in ("reconnect", "reconnects", "step_aside", "come_back"):
            self.assertTrue(hasattr(channel.Subscriber, name), name)
        with self.assertRaises(InvalidInput):
            channel.Subscriber("svc", reconnect="always")


class Errors(unittest.TestCase):
    def test_service_refusals_are_peer_errors_with_a_code(self):
        self.assertTrue(issubclass(ServiceError, PeerGone))
        self.assertTrue(issubclass(ServiceError, CudaIpcError))
        self.assertIs(cuda_ipc.ServiceError, ServiceError)
        self.assertIn("ServiceError", cuda_ipc.__all__)
        self.assertIn("service", cuda_ipc.__all__)


if __name__ == "__main__":
    unittest.main()
