"""The Python classes over the extension's: every public method of a core
class is reachable from its wrapper (under the same name, or the name
listed here), so a method added to the Rust side cannot be forgotten on the
Python side. No GPU: only the classes are inspected."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402,F401

from cuda_ipc import _core, channel  # noqa: E402

# Core methods the wrapper offers under another name, or uses internally
# (the value says which wrapper method covers it).
RENAMED = {
    ("Publisher", "arena_alloc"): "alloc",
    ("Publisher", "arena_reserve"): "reserve",
    ("Publisher", "arena_buffer_at"): "publish_state_dict",
    ("Publisher", "arena_buffer_containing"): "publish_state_dict",
}

PAIRS = [
    (channel.Publisher, _core.Publisher),
    (channel.Subscriber, _core.Subscriber),
    (channel.Published, _core.Published),
    (channel.Attachment, _core.Attachment),
    (channel.RingPublisher, _core.RingPublisher),
    (channel.Ring, _core.Ring),
]


def _public(cls):
    return sorted(n for n in dir(cls) if not n.startswith("_"))


class Surface(unittest.TestCase):
    def test_every_core_method_is_reachable_from_its_wrapper(self):
        for wrapper, core in PAIRS:
            for name in _public(core):
                covered = RENAMED.get((core.__name__, name), name)
                with self.subTest(cls=wrapper.__name__, method=name):
                    self.assertTrue(hasattr(wrapper, covered),
                                    f"{core.__name__}.{name} of the extension has no counterpart "
                                    f"on cuda_ipc.{wrapper.__name__} ({covered})")

    def test_the_renamed_methods_exist_on_both_sides(self):
        cores = {core.__name__: core for _, core in PAIRS}
        wrappers = {core.__name__: wrapper for wrapper, core in PAIRS}
        for (cls, name), covered in RENAMED.items():
            self.assertTrue(hasattr(cores[cls], name), f"_core.{cls}.{name} is gone: drop it from RENAMED")
            self.assertTrue(hasattr(wrappers[cls], covered), f"cuda_ipc.{cls}.{covered} is gone")


if __name__ == "__main__":
    unittest.main()


class ModulesShowTheirApi(unittest.TestCase):
    """dir() of the package and of each public module lists its API: no
    implementation modules, imports or helpers."""

    def test_dir_is_the_api(self):
        import cuda_ipc
        from cuda_ipc import dtypes, errors, service, sets, torch

        self.assertEqual(dir(cuda_ipc), sorted([*cuda_ipc.__all__, "torch", "__version__"]))
        for module in (dtypes, errors, service, sets, torch):
            with self.subTest(module=module.__name__):
                self.assertEqual(dir(module), sorted(module.__all__))
        for module in (cuda_ipc, dtypes, errors, service, sets, torch):
            for name in module.__all__:
                with self.subTest(module=module.__name__, name=name):
                    self.assertTrue(hasattr(module, name), f"{module.__name__}.__all__ names {name}, which is missing")


class TypedSurface(unittest.TestCase):
    """The package is typed (py.typed), and _core.pyi is what
    scripts/core_stub.py makes from the extension that is installed."""

    def test_the_package_is_marked_typed(self):
        import cuda_ipc

        here = os.path.dirname(cuda_ipc.__file__)
        self.assertTrue(os.path.isfile(os.path.join(here, "py.typed")), here)
        self.assertTrue(os.path.isfile(os.path.join(here, "_core.pyi")), here)

    def test_the_stub_is_the_extensions(self):
        import importlib.util

        script = os.path.join(_path.REPO, "scripts", "core_stub.py")
        spec = importlib.util.spec_from_file_location("core_stub", script)
        core_stub = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(core_stub)
        with open(core_stub.STUB) as f:
            committed = f.read()
        self.assertEqual(committed, core_stub.stub(_core),
                         "python/cuda_ipc/_core.pyi is out of date: run python scripts/core_stub.py "
                         "with the extension installed")
