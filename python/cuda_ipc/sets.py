"""Set records: the weights of a model (many named buffers) in the chunks of
one arena, as one language-neutral record (``cuda_ipc::set::SetRecord``):
checked by the library's decoder, and each entry's descriptor, which
:func:`cuda_ipc.open` maps.

Publishing and attaching whole sets over the channel (a state dict in, a
dict of tensors out) builds on these records and the library's arenas.
"""

from . import _core

__all__ = ["parse_set_record", "set_entry_descriptor"]


def parse_set_record(record):
    """Checks a set record (dict, JSON text or bytes); returns it in
    canonical form. Raises :class:`DescriptorError` naming the field."""
    return _core.parse_set_record(record)


def set_entry_descriptor(record, index):
    """The descriptor of entry ``index``: its bytes in its chunk, with the
    entry's element type and shape."""
    return _core.set_entry_descriptor(record, index)
