"""Sets: many named buffers (a model's weights) in the chunks of one
publisher's arena, handed off as one entry over the channel, and state
dicts published and attached as sets.

Publisher (a trainer)::

    pub = cuda_ipc.Publisher("weights")
    shared = pub.publish_state_dict("model", model.state_dict())  # copied once
    model.load_state_dict(shared, assign=True)   # the model now trains in the shared memory
    ...; optimizer.step(); pub.update_state_dict("model")

Subscriber (an inference server, another process)::

    sub = cuda_ipc.Subscriber("weights")
    sd = sub.attach_state_dict("model")          # zero copy: views of the mapped chunks
    model.load_state_dict(sd, assign=True)
    sd.wait_update(timeout=30)                   # the next update is visible to every stream

A publisher made with ``read_only_readers=True`` (or a subscriber that asks,
``attach_state_dict("model", read_only=True)``) maps the tensors read-only:
a kernel writing to them fails and the publisher's bytes do not change
(``sd.read_only``; VMM memory only).

The set record (``cuda_ipc::set::SetRecord``) is language neutral: Rust
programs and ``cuda-ipc attach --set`` read sets published from Python, and
Python attaches sets published by Rust (``cuda-ipc serve --set``).

Element types: the 21 of :mod:`cuda_ipc.dtypes` (bool, the 8-64 bit
integers, float16, bfloat16, float32, float64, the five float8 types,
float4_e2m1fn_x2, complex64, complex128); each entry carries its type's
name, and :meth:`Subscriber.attach_state_dict` gives the same torch dtype
back. Other PyTorch types (the sub-byte uint1..uint7 and int1..int7,
quantized types, complex32) are refused with :class:`InvalidInput` naming
the type, before anything is allocated: publish such a tensor's bytes
(``t.view(torch.uint8)``) and view them back after attaching.

A set entry holds at least one byte; an empty tensor of a state dict (a
dimension of 0) travels as a one-element entry named
``.cuda-ipc/empty/<dims>/<key>`` (dims joined by ``x``), which
:meth:`Subscriber.attach_state_dict` turns back into an empty tensor of the
same dtype and shape.

Tied tensors (two keys of one tensor, as a language model's input
embedding and output projection often are) stay tied: the first key is an
entry, each other key a one-byte entry named
``.cuda-ipc/alias/<index>/<key>`` (``index``: the first key's entry), which
:meth:`Subscriber.attach_state_dict` turns into the same tensor object, so
``load_state_dict(sd, assign=True)`` ties the parameters again. Tensors
that share memory without being the same view (overlapping slices of one
storage) are copied apart, as entries cannot overlap.

Also: set records checked by the library's decoder, and each entry's
descriptor, which :func:`cuda_ipc.open` maps.
"""

import warnings

from . import _core
from . import _torch_c
from . import dtypes as _dtypes
from . import streams as _streams
from .errors import InvalidInput
from .mapping import _as_cupy, _as_torch, _torch

__all__ = [
    "ArenaBuffer",
    "SetAttachment",
    "StateDict",
    "EMPTY_PREFIX",
    "ALIAS_PREFIX",
    "empty_entry_name",
    "parse_empty_entry_name",
    "alias_entry_name",
    "parse_alias_entry_name",
    "set_dtype",
    "parse_set_record",
    "set_entry_descriptor",
]


def __dir__():
    # dir() shows the module's API, not its imports and helpers.
    return sorted(__all__)

# Entry names under this prefix carry what a set entry cannot hold as it
# is (tied and empty tensors); state dict keys may not start with it. The
# names are made and read by the library (cuda_ipc::set::names) only.
RESERVED_PREFIX = _core.RESERVED_PREFIX
EMPTY_PREFIX = _core.EMPTY_PREFIX
ALIAS_PREFIX = _core.ALIAS_PREFIX

# The longest entry name a set record takes (cuda_ipc::set::MAX_SET_NAME_LEN).
MAX_NAME_BYTES = _core.MAX_SET_NAME_LEN


def parse_set_record(record):
    """Checks a set record (dict, JSON text or bytes; format 1, or format 2
    as publishers send it, the entries a base64 table); returns it in
    format 1, every entry a list ``[name, dtype, shape, chunk, offset,
    len]``. Raises :class:`DescriptorError` naming the field."""
    return _core.parse_set_record(record)


def set_entry_descriptor(record, index):
    """The descriptor of entry ``index``: its bytes in its chunk, with the
    entry's element type and shape."""
    return _core.set_entry_descriptor(record, index)


def set_dtype(dtype, what="tensor"):
    """The :class:`cuda_ipc.dtypes.DType` a set stores for a PyTorch dtype
    (``torch.bfloat16`` or ``"bfloat16"``); :class:`InvalidInput` naming
    ``what`` for a type a set does not hold."""
    dt = _dtypes.from_torch(dtype)
    if dt is None:
        known = ", ".join(d.torch for d in _dtypes.DTYPES)
        raise InvalidInput(
            f"{what} is {_dtypes.torch_name(dtype)}, which a set does not hold (it holds {known}); "
            f"convert it first (t.to(torch.float32)), or publish its bytes: view it as uint8 "
            f"(t.view(torch.uint8)) and view them back as {_dtypes.torch_name(dtype)} after attaching"
        )
    return dt


def empty_entry_name(key, shape):
    """The entry name that carries the empty tensor ``key`` of ``shape``."""
    dims = [int(d) for d in shape]
    name = _core.empty_entry_name(key, dims) if all(d >= 0 for d in dims) else None
    if name is None:
        raise InvalidInput(f"{key!r}: shape {dims} is not empty")
    return name


def parse_empty_entry_name(name):
    """``(key, shape)`` for an entry made by :func:`empty_entry_name`, else
    ``None``."""
    role = _core.entry_role(name)
    return (role[1], role[2]) if role[0] == "empty" else None


def alias_entry_name(index, key):
    """The entry name that says ``key`` is the same tensor as entry
    ``index`` of the set."""
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise InvalidInput(f"{key!r}: an alias names an entry by its index, not {index!r}")
    return _core.alias_entry_name(index, key)


def parse_alias_entry_name(name):
    """``(index, key)`` for an entry made by :func:`alias_entry_name`, else
    ``None``."""
    role = _core.entry_role(name)
    return (role[1], role[2]) if role[0] == "alias" else None


def _raw_name(name, raw):
    """The descriptor name a ``raw`` view of ``name`` shows (bool -> u8,
    u16 -> i16, f8e4m3fn -> u8, ...: the library's table)."""
    return _dtypes.raw_name(name, raw)


# --- the publisher's side -------------------------------------------------------


class ArenaBuffer:
    """A buffer of a publisher's arena (:meth:`Publisher.alloc`): fill it
    through :meth:`as_torch` / :meth:`as_cupy`, then publish it in a set
    (:meth:`Publisher.publish_set`). Tensors made from it keep it alive."""

    __slots__ = ("_c",)

    def __init__(self, core):
        self._c = core

    ptr = property(lambda self: self._c.ptr, doc="Device address of the first byte.")
    nbytes = property(lambda self: self._c.nbytes, doc="Length in bytes.")
    offset = property(lambda self: self._c.offset, doc="Bytes from the start of its chunk.")
    chunk = property(lambda self: self._c.chunk, doc="The index of its chunk in the arena.")
    device = property(lambda self: self._c.device, doc="The CUDA device ordinal.")

    def view(self, dtype="u8", shape=None):
        return self._c.view(dtype, None if shape is None else [int(d) for d in shape])

    def as_torch(self, dtype="u8", shape=None):
        """The buffer as a torch tensor of ``dtype`` and ``shape`` (default:
        every whole element, one dimension); it keeps the buffer alive."""
        dt = _dtypes.lookup(dtype)
        if dt is None:
            raise InvalidInput(f"unknown dtype {dtype!r}; known: {', '.join(_dtypes.names())}")
        return _as_torch(lambda n, raw: self.view(_raw_name(n, raw), shape), dt.name)

    def as_cupy(self, dtype="u8", shape=None):
        """The buffer as a CuPy array of ``dtype`` and ``shape``."""
        dt = _dtypes.lookup(dtype)
        if dt is None:
            raise InvalidInput(f"unknown dtype {dtype!r}; known: {', '.join(_dtypes.names())}")
        return _as_cupy(lambda n, raw: self.view(_raw_name(n, raw), shape), dt.name, self.device)

    def __repr__(self):
        return repr(self._c)


def _core_buffer(buffer):
    return buffer._c if isinstance(buffer, ArenaBuffer) else buffer


def publish_set(pub, name, members, stream=None):
    """:meth:`Publisher.publish_set`."""
    handle = _streams.stream_handle(stream)
    core = []
    for i, m in enumerate(members):
        try:
            member, buffer, dtype, shape, *rest = m
            offset = int(rest[0]) if rest else 0
            if len(rest) > 1:
                raise ValueError
        except (TypeError, ValueError):
            raise InvalidInput(f"set member {i} is not (name, buffer, dtype, shape) or "
                               f"(name, buffer, dtype, shape, offset)") from None
        if offset < 0:
            raise InvalidInput(f"set member {i} ({member!r}): the offset {offset} is negative")
        dt = _dtypes.lookup(dtype)
        if dt is None:
            raise InvalidInput(f"set member {i} ({member!r}): unknown dtype {dtype!r}; known: "
                               f"{', '.join(_dtypes.names())}")
        core.append((str(member), _core_buffer(buffer), dt.name, [int(d) for d in shape], offset))
    pub._c.publish_set(str(name), core, handle)
    pub._sets.add(str(name))


class _PublishedStateDict:
    __slots__ = ("tensors", "buffers")

    def __init__(self, tensors, buffers):
        self.tensors, self.buffers = tensors, buffers


def _check_name(name):
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"the set's name must be a non-empty string, not {name!r}")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise InvalidInput(f"the set's name is longer than the {MAX_NAME_BYTES} bytes a set record takes")


def _check_items(state_dict):
    """The state dict's items, after the checks that need no torch."""
    if not hasattr(state_dict, "items"):
        raise InvalidInput(f"expected a state dict (a mapping of names to tensors), not {type(state_dict).__name__}")
    items = list(state_dict.items())
    if not items:
        raise InvalidInput("the state dict is empty; a set holds at least one tensor")
    for key, _ in items:
        if not isinstance(key, str) or not key:
            raise InvalidInput(f"state dict keys must be non-empty strings, not {key!r}")
        if key.startswith(RESERVED_PREFIX):
            raise InvalidInput(f"{key!r}: keys starting with {RESERVED_PREFIX!r} are reserved")
    return items


def _same_view(t):
    """What makes two tensors the same view of the same memory."""
    return (t.device.type, t.device.index, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def _same_as(starting_here, key, t):
    """The key of an earlier tensor in ``starting_here`` (the tensors that
    start at ``t``'s address) that is the same view as ``t``, else ``None``
    (and ``t`` joins the list)."""
    if starting_here:
        view = _same_view(t)
        for other_key, other in starting_here:
            if _same_view(other) == view:
                return other_key
    starting_here.append((key, t))
    return None


def _keep_apart(plan):
    """Arena ranges found for different keys may overlap (slices of one
    storage); set entries cannot. Every found range that overlaps one
    before it (by address) is copied instead: its ``found`` becomes None."""
    ranges = sorted(
        (t.data_ptr(), t.data_ptr() + nbytes, i)
        for i, (_key, t, _dt, nbytes, _entry, found) in enumerate(plan)
        if found is not None
    )
    end = None
    for start, stop, i in ranges:
        if end is not None and start < end:
            key, t, dt, nbytes, entry, _ = plan[i]
            plan[i] = (key, t, dt, nbytes, entry, None)
        else:
            end = stop if end is None else max(end, stop)


def _copy_into(torch, dst, src):
    """``dst.copy_(src)``; tensors of the fp8/fp4 types as their bytes
    (uint8 views with the same shape and strides, which every PyTorch
    copies, strided or not), as PyTorch implements few operations on them."""
    dt = _dtypes.from_torch(dst.dtype)
    if dt is not None and dt.name in _dtypes.BITS_ONLY:
        dst.view(torch.uint8).copy_(src.view(torch.uint8))
    else:
        dst.copy_(src)


def _round_up(n, unit=256):
    return (n + unit - 1) // unit * unit


def publish_state_dict(pub, name, state_dict, stream=None):
    """:meth:`Publisher.publish_state_dict`."""
    _check_name(name)
    if name in pub._state_dicts:
        raise InvalidInput(f"{name!r} is published already; update it with update_state_dict, "
                           f"or unpublish it first")
    if stream is None:
        return _publish_state_dict(pub, name, state_dict)
    with _streams.torch_on(_torch(), pub.device, stream):
        return _publish_state_dict(pub, name, state_dict)


def _publish_state_dict(pub, name, state_dict):
    """:func:`publish_state_dict`, ordered after PyTorch's current stream."""
    if _torch_c.exchange() is not None:
        # The same steps, in the extension (see cuda_ipc._torch_c).
        tensors, record, copied, copied_bytes, first_copied = _torch_c.publish_state_dict(
            pub, name, state_dict, _streams.torch_current(_torch(), pub.device))
        pub._sets.add(name)
        pub._state_dicts[name] = record
        if copied:
            warnings.warn(copy_warning(name, copied, copied_bytes, first_copied), stacklevel=3)
        return tensors
    items = _check_items(state_dict)
    torch = _torch()
    tensor_type = torch.Tensor
    containing = pub._c.arena_buffer_containing
    plan = []
    aliases = []  # (key, key of the same tensor earlier in the plan)
    first_at = {}  # data_ptr -> [(key, tensor)] of the entries starting there
    dtypes = {}  # torch dtype -> DType, checked once per dtype
    for key, t in items:
        if not isinstance(t, tensor_type):
            raise InvalidInput(f"{key!r} is a {type(t).__name__}, not a torch tensor")
        dt = dtypes.get(t.dtype)
        if dt is None:
            dt = dtypes[t.dtype] = set_dtype(t.dtype, repr(key))
        nbytes = t.nbytes
        if nbytes:
            # The same view of the same memory (tied weights) is one entry
            # and an alias; looked at only where two tensors start together.
            ptr = t.data_ptr()
            same = _same_as(first_at.setdefault(ptr, []), key, t)
            if same is not None:
                aliases.append((key, same))
                continue
            entry = key
        else:
            entry = empty_entry_name(key, t.shape)
        if len(entry) > MAX_NAME_BYTES // 4 and len(entry.encode()) > MAX_NAME_BYTES:
            raise InvalidInput(f"{key!r}: the entry name is longer than the {MAX_NAME_BYTES} bytes a set takes")
        # A tensor inside a buffer of this publisher's arena (one it returned
        # before, a view of alloc(), or a tensor made in a shareable() block,
        # which torch's caching allocator placed in one of its segments) is
        # published where it is: (buffer, offset of its first byte).
        found = None
        if nbytes and t.is_cuda and t.device.index == pub.device and t.is_contiguous():
            found = containing(ptr, nbytes)
        plan.append((key, t, dt, nbytes, entry, found))
    _keep_apart(plan)
    # One chunk for everything copied (and a byte per alias), when it fits one.
    need = sum(_round_up(max(n, dt.size)) for _, _, dt, n, _, found in plan if found is None)
    need += _round_up(1) * len(aliases)
    if need:
        pub._c.arena_reserve(need)
    device = torch.device("cuda", pub.device)
    members, tensors, buffers = [], {}, []
    copied = copied_bytes = 0
    first_copied = None
    with torch.no_grad():
        for key, t, dt, nbytes, entry, found in plan:
            shape = list(t.shape)
            offset = 0
            if found is not None:
                (buf, offset), dst = found, t
            else:
                buf = pub._c.arena_alloc(max(nbytes, dt.size))
                if nbytes:
                    dst = _as_torch(lambda n, raw, b=buf, s=shape: b.view(_raw_name(n, raw), s), dt.name)
                    _copy_into(torch, dst, t)  # on the current stream; non-contiguous sources become contiguous
                    copied += 1
                    copied_bytes += nbytes
                    first_copied = key if first_copied is None else first_copied
                else:
                    dst = torch.empty(shape, dtype=t.dtype, device=device)
            buffers.append(buf)
            tensors[key] = dst
            members.append((entry, buf, dt.name, shape if nbytes else [1], offset))
        index = {key: i for i, (key, *_rest) in enumerate(plan)}
        for key, same in aliases:
            entry = alias_entry_name(index[same], key)
            if len(entry.encode()) > MAX_NAME_BYTES:
                raise InvalidInput(f"{key!r}: the entry name is longer than the {MAX_NAME_BYTES} bytes a set takes")
            buf = pub._c.arena_alloc(1)
            buffers.append(buf)
            tensors[key] = tensors[same]
            members.append((entry, buf, "u8", [1], 0))
    # After the copies queued above and the tensors' writes.
    pub._c.publish_set(name, members, _streams.torch_current(torch, pub.device))
    pub._sets.add(name)
    pub._state_dicts[name] = _PublishedStateDict(tensors, buffers)
    if copied:
        warnings.warn(copy_warning(name, copied, copied_bytes, first_copied), stacklevel=3)
    return {key: tensors[key] for key, _ in items}


def copy_warning(name, copied, copied_bytes, first):
    """The warning of a publish_state_dict that copied tensors not born in
    the arena: how many, and how to avoid it."""
    return (
        f"publish_state_dict({name!r}) copied {copied} tensors ({copied_bytes / 2**20:.1f} MiB, e.g. {first!r}) "
        f"into the publisher's arena: they were not born in it. To avoid the copy, make the model inside "
        f"`with cuda_ipc.torch.shareable(publisher):` (every tensor made there lives in the arena), or train "
        f"in the tensors publish_state_dict returned (model.load_state_dict(returned, assign=True)) and "
        f"publish changes with update_state_dict. Non-contiguous tensors are always copied."
    )


def update_state_dict(pub, name, state_dict=None, stream=None):
    """:meth:`Publisher.update_state_dict`."""
    st = pub._state_dicts.get(name)
    if st is None:
        raise InvalidInput(f"{name!r} was not published by this publisher's publish_state_dict")
    if stream is None:
        return _update_state_dict(pub, name, st, state_dict)
    with _streams.torch_on(_torch(), pub.device, stream):
        return _update_state_dict(pub, name, st, state_dict)


def _update_state_dict(pub, name, st, state_dict):
    """:func:`update_state_dict`, ordered after PyTorch's current stream."""
    if state_dict is not None and isinstance(st, _core.StateDictRecord):
        _torch_c.update_copies(st, state_dict)
    elif state_dict is not None:
        items = _check_items(state_dict)
        missing = [k for k in st.tensors if k not in state_dict]
        extra = [k for k, _ in items if k not in st.tensors]
        if missing or extra:
            raise InvalidInput(
                f"the state dict does not have the keys of {name!r}: "
                + "; ".join(s for s in (
                    f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else "",
                    f"unknown {extra[:5]}{' ...' if len(extra) > 5 else ''}" if extra else "",
                ) if s))
        torch = _torch()
        for key, src in items:
            dst = st.tensors[key]
            if not isinstance(src, torch.Tensor):
                raise InvalidInput(f"{key!r} is a {type(src).__name__}, not a torch tensor")
            if src.dtype != dst.dtype or tuple(src.shape) != tuple(dst.shape):
                raise InvalidInput(f"{key!r} is {src.dtype} {list(src.shape)}; the published tensor is "
                                   f"{dst.dtype} {list(dst.shape)}")
        with torch.no_grad():
            for key, src in items:
                dst = st.tensors[key]
                if dst.numel() == 0 or (src.data_ptr() == dst.data_ptr() and src.is_contiguous()):
                    continue
                _copy_into(torch, dst, src)
    # After the copies queued above and the writes before them.
    return pub._c.update_set(name, _streams.torch_current_if_loaded(pub.device))


def unpublish_set(pub, name, timeout=None):
    """:meth:`Publisher.unpublish_set`."""
    try:
        pub._c.unpublish_set(name, timeout)
    finally:
        # Hidden even when the wait timed out: the name is free again, and
        # the set's memory stays until its last lease ends.
        pub._sets.discard(name)
        pub._state_dicts.pop(name, None)


# --- the subscriber's side ------------------------------------------------------


class SetAttachment:
    """A set attached from a publisher: one lease, every chunk mapped once.
    Entries by index or name (``len(s)``, ``name in s``, :attr:`names`,
    :attr:`entries`); :meth:`as_torch` / :meth:`as_cupy` / :meth:`view` make
    zero-copy views that hold the lease too: it ends at :meth:`release`, or
    when this object and the last view are gone (also when this process
    exits or is killed)."""

    __slots__ = ("_c", "_entry_list", "__weakref__")

    def __init__(self, core):
        self._c = core
        # Built on first use: attaching a state dict through the C exchange
        # API never needs the per-entry tuples (one Python tuple per tensor).
        self._entry_list = None

    @property
    def _entries(self):
        entries = self._entry_list
        if entries is None:
            entries = self._entry_list = self._c.entries
        return entries

    name = property(lambda self: self._c.name, doc="The set's name.")
    lease = property(lambda self: self._c.lease, doc="The lease id.")
    device = property(lambda self: self._c.device, doc="The CUDA device ordinal.")
    layout_hash = property(lambda self: self._c.layout_hash,
                           doc="The layout hash of its entries, as a weight service's commit names it.")
    nbytes = property(lambda self: self._c.nbytes, doc="The bytes of every entry together.")
    released = property(lambda self: self._c.released, doc="Whether release() was called.")
    uses_fence = property(lambda self: self._c.uses_fence, doc="Whether updates wait on a fence.")
    read_only = property(lambda self: self._c.read_only,
                         doc="Whether the chunks are mapped read-only: writing through any view fails.")
    record = property(lambda self: self._c.record, doc="The set record the publisher sent.")

    @property
    def entries(self):
        """``[(name, dtype, shape, ptr, nbytes)]`` in the publisher's order."""
        return list(self._entries)

    @property
    def names(self):
        return [e[0] for e in self._entries]

    def __len__(self):
        return len(self._entries)

    def __contains__(self, name):
        return self._c.index(name) is not None

    def _dtype_of(self, key):
        if isinstance(key, int):
            if not 0 <= key < len(self._entries):
                raise InvalidInput(f"index {key} is past the {len(self._entries)} entries of {self.name!r}")
            return self._entries[key][1]
        i = self._c.index(key)
        if i is None:
            raise InvalidInput(f"{self.name!r} has no entry called {key!r}")
        return self._entries[i][1]

    def view(self, key, dtype=None, raw=False):
        return self._c.view(key, dtype, raw)

    def as_torch(self, key, dtype=None):
        """Entry ``key`` (an index or a name) as a torch tensor (zero copy);
        it holds the lease."""
        return _as_torch(lambda n, raw: self._c.view(key, n, raw), self._dtype_of(key), dtype)

    def as_cupy(self, key, dtype=None):
        """Entry ``key`` as a CuPy array (zero copy); it holds the lease."""
        return _as_cupy(lambda n, raw: self._c.view(key, n, raw), self._dtype_of(key), self.device, dtype)

    def wait_update(self, timeout=None):
        """Waits for the publisher's next update of the set; returns its
        version. Raises PeerGone when the publisher is gone or takes the set
        back, Timeout after ``timeout`` seconds."""
        return self._c.wait_update(timeout)

    def release(self):
        """Ends the lease now; raises InvalidInput while tensors made from
        it are alive (the lease then ends with the last of them)."""
        return self._c.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._c.__exit__(*exc)

    def __repr__(self):
        return repr(self._c)


class StateDict(dict):
    """A state dict attached from a publisher: a ``dict`` of torch tensors,
    zero-copy views of the publisher's memory, that
    ``model.load_state_dict(sd, assign=True)`` takes as they are (the model
    then runs on the shared memory; without ``assign`` the values are copied
    into the model's own tensors). :meth:`wait_update` waits for the next
    update, which every tensor sees in place.

    The tensors hold the set's lease: :meth:`release` (or leaving a ``with``
    block) drops this dict's tensors and ends the lease, or, while other
    tensors of it live (a model's parameters after ``assign=True``), raises
    InvalidInput for release() and leaves the lease to the last of them."""

    def __init__(self, attachment, tensors):
        super().__init__(tensors)
        self.attachment = attachment

    name = property(lambda self: self.attachment.name, doc="The set's name.")
    lease = property(lambda self: self.attachment.lease, doc="The lease id.")
    read_only = property(lambda self: self.attachment.read_only,
                         doc="Whether the tensors' memory is mapped read-only: a kernel that "
                             "writes to them fails (torch does not know: the tensors carry no flag).")

    def wait_update(self, timeout=None):
        """Waits for the publisher's next update; returns its version."""
        return self.attachment.wait_update(timeout)

    def release(self):
        """Drops this dict's tensors and ends the lease (see the class)."""
        self.clear()
        return self.attachment.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.clear()
        return self.attachment.__exit__(*exc)


def attach_state_dict(core_attachment):
    """A :class:`StateDict` of the set ``core_attachment`` (a
    ``_core.SetAttachment``).

    Where PyTorch has the DLPack C exchange API (2.10 and later), the
    extension makes every tensor in one call (:mod:`cuda_ipc._torch_c`).
    Otherwise each run of entries (one mapped chunk, one dtype: ``runs``) is imported
    once through DLPack and its entries are ``torch.as_strided`` views of
    it: a DLPack import costs about 10 µs in PyTorch, a view about 1 µs.
    The views share the run's storage, which holds the set's lease."""
    if _torch_c.exchange() is not None:
        return _torch_c.attach_state_dict(core_attachment)
    a = SetAttachment(core_attachment)
    try:
        torch = _torch()
        as_strided = torch.as_strided
        runs, places = a._c.runs
        bases = [None] * len(runs)
        tensors = {}
        device = torch.device("cuda", a.device)
        keys = []
        for i, (entry, dtype, shape, _ptr, _nbytes) in enumerate(a._entries):
            if entry.startswith(RESERVED_PREFIX):
                key, value = _special_entry(a, i, entry, dtype, keys, tensors, torch, device)
            elif places[i] is None:
                key, value = entry, a.as_torch(i)
            else:
                run, offset, strides = places[i]
                base = bases[run]
                if base is None:
                    base = bases[run] = _as_torch(lambda n, raw, r=run: a._c.run_view(r, n, raw), runs[run][2])
                key, value = entry, as_strided(base, shape, strides, offset)
            if key in tensors:
                raise InvalidInput(f"{a.name!r} holds {key!r} twice")
            keys.append(key)
            tensors[key] = value
        del bases
    except BaseException:
        tensors = bases = None
        a.__exit__(None, None, None)
        raise
    return StateDict(a, tensors)


def _special_entry(a, i, entry, dtype, keys, tensors, torch, device):
    """``(key, tensor)`` of entry ``i``, whose name starts with
    RESERVED_PREFIX: an alias of an earlier entry, or an empty tensor; any
    other such name is an ordinary entry."""
    role = _core.entry_role(entry)
    if role[0] == "alias":
        _, index, key = role
        if index >= len(keys):
            raise InvalidInput(f"{a.name!r}: {key!r} is an alias of entry {index}, which is not before it")
        return key, tensors[keys[index]]
    if role[0] == "empty":
        _, key, shape = role
        dt = _dtypes.by_name(dtype)
        target = getattr(torch, dt.torch, None)
        if target is None:
            raise InvalidInput(f"{key!r}: this PyTorch has no torch.{dt.torch}")
        return key, torch.empty(shape, dtype=target, device=device)
    return entry, a.as_torch(i)
