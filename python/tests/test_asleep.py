"""The check that a module called on sleeping memory raises
``cuda_ipc.Asleep`` (``cuda_ipc.asleep``), without torch or a GPU: a stand-in
torch module records the global forward pre-hook, stand-in modules and
tensors carry addresses. That a real module raises before queuing work, and
the context goes on, is the GPU suite's (gpu_sleep.py)."""

import sys
import types
import unittest

import _path  # noqa: F401

import cuda_ipc  # noqa: E402
from cuda_ipc import asleep  # noqa: E402


class Handle:
    def __init__(self, hooks, fn):
        self.hooks, self.fn = hooks, fn

    def remove(self):
        self.hooks.remove(self.fn)


def stand_in_torch():
    hooks = []
    torch = types.ModuleType("torch")
    module = types.SimpleNamespace(register_module_forward_pre_hook=lambda fn: (hooks.append(fn), Handle(hooks, fn))[1])
    torch.nn = types.SimpleNamespace(modules=types.SimpleNamespace(module=module))
    return torch, hooks


class Tensor:
    is_cuda = True

    def __init__(self, ptr, n=1):
        self.ptr, self.n = ptr, n

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.n


class Module:
    def __init__(self, **params):
        self._parameters = params
        self._buffers = {}


class Owner:
    """Stands for a subscriber (weak-referenceable)."""


class Asleep(unittest.TestCase):
    def setUp(self):
        self.torch, self.hooks = stand_in_torch()
        self.saved = sys.modules.get("torch")
        sys.modules["torch"] = self.torch

    def tearDown(self):
        for key in list(asleep._by_subscriber):
            asleep.unguard(key)
        if self.saved is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = self.saved

    def call(self, module, *args):
        for hook in list(self.hooks):
            hook(module, args)

    def test_a_module_on_sleeping_memory_raises_naming_it_and_nothing_else_does(self):
        owner = Owner()
        asleep.watch(owner, [(0x1000, 0x1000), (0x8000, 0x100)])
        self.assertEqual(len(self.hooks), 1)
        with self.assertRaises(cuda_ipc.Asleep) as e:
            self.call(Module(weight=Tensor(0x1800)))
        self.assertIn("Module's parameter weight", str(e.exception))
        self.assertIn("Reader.come_back", str(e.exception))
        self.assertEqual(e.exception.ranges, ((0x1000, 0x1000), (0x8000, 0x100)))
        self.assertIsInstance(e.exception, cuda_ipc.InvalidInput)
        with self.assertRaises(cuda_ipc.Asleep) as e:
            self.call(Module(), Tensor(0x5000), Tensor(0x80ff))
        self.assertIn("argument 1", str(e.exception))
        # Just outside, empty, on the host, or not a tensor: no error.
        self.call(Module(weight=Tensor(0x2000)), Tensor(0xfff), Tensor(0x8100))
        self.call(Module(weight=Tensor(0x1800, n=0)))
        host = Tensor(0x1800)
        host.is_cuda = False
        self.call(Module(weight=host), 3, None, "x")

    def test_the_hook_goes_with_the_last_wake_or_owner(self):
        a, b = Owner(), Owner()
        asleep.watch(a, [(0x1000, 0x10)])
        asleep.watch(b, [(0x2000, 0x10)])
        self.assertEqual(len(self.hooks), 1, "one hook for every subscriber")
        asleep.watch(a, [])  # a woke
        self.call(Module(weight=Tensor(0x1000)))
        with self.assertRaises(cuda_ipc.Asleep):
            self.call(Module(weight=Tensor(0x2000)))
        del b  # gone while asleep: its ranges go with it
        import gc

        gc.collect()
        self.assertEqual(self.hooks, [])
        self.call(Module(weight=Tensor(0x2000)))
        # Many sleeps of one owner keep one finalizer.
        for _ in range(100):
            asleep.watch(a, [(0x1000, 0x10)])
            asleep.watch(a, [])
        self.assertLessEqual(len(asleep._finalizers), 1)

    def test_nothing_is_hooked_where_torch_was_never_imported(self):
        sys.modules.pop("torch")
        asleep.watch(Owner(), [(0x1000, 0x10)])
        self.assertEqual(self.hooks, [])

    def test_a_subscriber_watches_after_sleep_wake_and_come_back(self):
        class Core:
            def __init__(self):
                self.ranges = []

            def sleep(self, unchecked=False):
                self.ranges = [(0x4000, 0x100)]
                return (1, 0x100)

            def wake(self):
                self.ranges = []
                return (1, 0x100)

            def come_back(self, name, next=False, timeout=0):
                raise cuda_ipc.ServiceError("torn")

            def sleeping_ranges(self):
                return self.ranges

        s = cuda_ipc.Subscriber.__new__(cuda_ipc.Subscriber)
        s._c = Core()
        s.sleep(unchecked=True)
        with self.assertRaises(cuda_ipc.Asleep):
            self.call(Module(weight=Tensor(0x4010)))
        with self.assertRaises(cuda_ipc.ServiceError):
            s.come_back("m")  # a torn set: still asleep, still checked
        with self.assertRaises(cuda_ipc.Asleep):
            self.call(Module(weight=Tensor(0x4010)))
        s.wake()
        self.call(Module(weight=Tensor(0x4010)))
        self.assertEqual(self.hooks, [])


if __name__ == "__main__":
    unittest.main()
