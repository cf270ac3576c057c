"""Descriptors: checked, normalised and written by the Rust library's
decoder (``cuda_ipc::Descriptor``), so Python and Rust agree on every rule
and every message."""

from . import _core

__all__ = ["FORMAT_VERSION", "parse_descriptor", "validate_descriptor", "descriptor_json", "cuda_array_interface"]


def __dir__():
    # dir() shows the module's API, not its imports and helpers.
    return sorted(__all__)

FORMAT_VERSION = _core.FORMAT_VERSION


def parse_descriptor(descriptor):
    """A descriptor (JSON text, bytes, or a dict) checked and returned as a
    dict in canonical form. Raises :class:`DescriptorError` naming the field."""
    return _core.parse_descriptor(descriptor)


def validate_descriptor(d):
    """Checks a descriptor dict; returns it in canonical form (lower-case
    hex, ``elem_size`` filled in, absent optional fields left out)."""
    return _core.parse_descriptor(d)


def descriptor_json(d):
    """A descriptor's canonical JSON text (one line)."""
    return _core.descriptor_json(d)


def cuda_array_interface(ptr, d, stream=None, raw=False):
    """The ``__cuda_array_interface__`` (version 3) of the exported bytes of
    descriptor ``d`` mapped at device address ``ptr`` (the first exported
    byte). ``stream`` is the interface's ``stream`` value (``None``, or a
    stream handle; 0 is refused). With ``raw``, the type string is a
    same-sized integer type every consumer can build."""
    return _core.cuda_array_interface(ptr, d, stream, raw)
