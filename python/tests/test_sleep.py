"""Sleep from Python without a GPU (the extension's subscriber stood in
for): a sleep is checked unless the caller says ``unchecked=True``, through
``cuda_ipc.Subscriber`` and ``service.Reader`` alike, and the extension's
``sleep`` takes the flag, off by default. What a checked sleep refuses is
the GPU suite's (gpu_sleep.py)."""

import unittest

import _path  # noqa: F401

import cuda_ipc  # noqa: E402
from cuda_ipc import _core, service  # noqa: E402


class StandInCore:
    def __init__(self):
        self.sleeps = []

    def sleep(self, *, unchecked=False):
        self.sleeps.append(unchecked)
        return (0, 0)

    def sleeping_ranges(self):
        return []


def subscriber(core):
    s = cuda_ipc.Subscriber.__new__(cuda_ipc.Subscriber)
    s._c = core
    return s


class Sleep(unittest.TestCase):
    def test_a_sleep_is_checked_unless_the_caller_says_unchecked(self):
        core = StandInCore()
        s = subscriber(core)
        s.sleep()
        s.sleep(unchecked=True)
        self.assertEqual(core.sleeps, [False, True])

    def test_a_service_reader_passes_the_flag_on(self):
        core = StandInCore()
        r = service.Reader.__new__(service.Reader)
        r.subscriber = subscriber(core)
        r.sleep()
        r.sleep(unchecked=True)
        self.assertEqual(core.sleeps, [False, True])

    def test_the_extension_checks_by_default(self):
        sig = getattr(_core.Subscriber.sleep, "__text_signature__", "") or ""
        self.assertIn("unchecked=False", sig)


if __name__ == "__main__":
    unittest.main()
