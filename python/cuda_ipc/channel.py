"""The exchange channel from Python: buffers published by name over a Unix
socket, with leases, an event per publish, rings. The same protocol as Rust
``cuda_ipc::exchange`` and ``cuda-ipc serve`` / ``cuda-ipc attach``, so
either side may be Python or Rust.

Publisher::

    with cuda_ipc.Publisher("weights") as pub:
        p = pub.publish("w", tensor)          # copied once into shareable memory
        w = p.as_torch()                      # the shared tensor: update it in place
        w.add_(1); pub.update("w")            # subscribers see version 1

Subscriber (another process)::

    with cuda_ipc.Subscriber("weights") as sub, sub.attach("w") as a:
        w = a.as_torch()                      # zero copy; holds the lease
        a.wait_update(timeout=10)             # the next update is visible to every stream
    # the lease ends when `a` is released and the last tensor made from it is gone

Publishing and updating wait for the work queued so far on the device (on
every stream, PyTorch's and CuPy's included), then record the event;
attaching and receiving an update wait on the host for that event. Given
``stream=``, :meth:`Publisher.update`, :meth:`Publisher.publish_set`,
:meth:`Publisher.update_set` and :meth:`RingPublisher.publish` order their
event after that one stream instead, on the device (the call does not wait
for the GPU; see :mod:`cuda_ipc.streams`); the state dict calls do so
after PyTorch's current stream by default.

Sets (many buffers of the publisher's arena in one entry) and whole state
dicts: :meth:`Publisher.publish_state_dict`, :meth:`Subscriber.attach_state_dict`
and the lower-level :meth:`Publisher.alloc` / :meth:`Publisher.publish_set` /
:meth:`Subscriber.attach_set`; see :mod:`cuda_ipc.sets`.

Read-only readers: ``Publisher(..., read_only_readers=True)`` makes every
reader map its sets read-only, and a subscriber may ask for read-only itself
(``Subscriber(..., read_only=True)``, or ``attach_set(name, read_only=True)``
and ``attach_state_dict(name, read_only=True)``). A kernel that writes
through a read-only mapping fails (CUDA reports an illegal address, which
leaves that process's CUDA context unusable) and the publisher's bytes do
not change. Only VMM memory can be mapped read-only: legacy and pool memory
are refused with :class:`Unavailable`. It guards against mistakes, not a
hostile reader.
"""

from . import _core
from . import dtypes as _dtypes
from . import sets as _sets
from . import streams as _streams
from .errors import CudaIpcError, InvalidInput
from .mapping import _as_cupy, _as_torch, _torch

__all__ = ["Publisher", "Subscriber", "Published", "Attachment", "RingPublisher", "Ring", "Frame"]


def __dir__():
    # dir() shows the module's API, not its imports and helpers.
    return sorted(__all__)


class _Owner:
    """Context manager plumbing shared by the channel's owners."""

    __slots__ = ("_c", "__weakref__")

    def __init__(self, core):
        self._c = core

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._c.__exit__(*exc)

    def __repr__(self):
        return f"<cuda_ipc.{type(self).__name__} {getattr(self._c, 'name', '')}>"


class Published(_Owner):
    """A buffer this process publishes: write it through :meth:`as_torch` /
    :meth:`as_cupy` / :meth:`view`, then ``Publisher.update(name)``."""

    name = property(lambda self: self._c.name)
    mechanism = property(lambda self: self._c.mechanism)
    dtype = property(lambda self: self._c.dtype)
    shape = property(lambda self: self._c.shape)

    def view(self, dtype=None, raw=False):
        return self._c.view(dtype, raw)

    def as_torch(self, dtype=None):
        return _as_torch(self._c.view, self.dtype, dtype)

    def as_cupy(self, dtype=None):
        return _as_cupy(self._c.view, self.dtype, _device_of(self._c), dtype)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _device_of(core):
    return core.view().__dlpack_device__()[1]


class Publisher(_Owner):
    """Serves device buffers by name (see the module documentation).

    ``endpoint`` is a name (a socket under ``$XDG_RUNTIME_DIR/cuda-ipc/``)
    or a path containing ``/``; ``allow_uids`` lets other users connect.
    With ``read_only_readers``, readers map every set and state dict
    read-only (the arena is then made of vmm chunks); :meth:`publish` and
    :meth:`ring`, which have no set record to carry that, are refused.
    """

    def __init__(self, endpoint, *, device=0, allow_uids=(), read_only_readers=False):
        super().__init__(_core.Publisher(str(endpoint), device=device, allow_uids=list(allow_uids),
                                         read_only_readers=bool(read_only_readers)))
        self._sets = set()
        self._state_dicts = {}
        self._torch_pool = None  # cuda_ipc.torch.pool(self), made on first use
        self._torch_blocks = 0  # shareable(self) blocks running

    path = property(lambda self: self._c.path, doc="The socket path.")
    device = property(lambda self: self._c.device, doc="The CUDA device ordinal.")
    read_only_readers = property(lambda self: self._c.read_only_readers,
                                 doc="Whether readers map what this publisher publishes read-only.")

    def publish(self, name, source=None, *, shape=None, dtype=None, mechanism=None):
        """Publishes ``name``: a copy of ``source`` (a torch tensor, or any
        object torch.as_tensor reads) in shareable memory, or, without a
        source, new memory of ``shape`` and ``dtype`` (contents undefined
        until you write them and call :meth:`update`). ``mechanism``:
        ``legacy``, ``vmm``, ``pool``, ``fabric`` or ``None`` (the best
        here). Returns a :class:`Published`."""
        if source is not None:
            torch = _torch()
            if not isinstance(source, torch.Tensor):
                source = torch.as_tensor(source, device=f"cuda:{self.device}")
            shape = list(source.shape)
            dtype = _dtypes.torch_name(source.dtype)
        if shape is None:
            raise CudaIpcError("publish needs a source tensor, or a shape (and a dtype)")
        dt = _dtypes.lookup(dtype or "u8")
        if dt is None:
            raise CudaIpcError(f"unknown dtype {dtype!r}; known: {', '.join(_dtypes.names())}")
        shape = [int(x) for x in shape]
        count = 1
        for d in shape:
            count *= d
        alloc = self._c.alloc(max(count * dt.size, 1), mechanism)
        if source is not None:
            dst = _as_torch(lambda n, raw: alloc.view(_raw_name(n, raw), shape), dt.name)
            dst.copy_(source.reshape(shape))
            del dst
        return Published(self._c.publish(name, alloc, dt.name, shape))

    def update(self, name, stream=None):
        """Tells subscribers of ``name`` that new contents are ready; returns
        the version (from 1). Ordered after the work queued so far on this
        device (the host waits for it), or, given ``stream`` (see
        :mod:`cuda_ipc.streams`), after the work queued on that stream (the
        device waits; the call does not)."""
        return self._c.update(name, _streams.stream_handle(stream))

    def unpublish(self, name, timeout=None):
        """Hides ``name`` (a buffer or a set) and waits up to ``timeout``
        seconds (``None``: for ever) until every lease on it is released."""
        if name in self._sets:
            return _sets.unpublish_set(self, name, timeout)
        return self._c.unpublish(name, timeout)

    # --- arenas and sets -------------------------------------------------------

    def alloc(self, nbytes):
        """``nbytes`` of this publisher's arena (no export: a chunk is
        exported once, when it is made), as a :class:`cuda_ipc.sets.ArenaBuffer`
        to fill and publish with :meth:`publish_set`."""
        return _sets.ArenaBuffer(self._c.arena_alloc(int(nbytes)))

    def reserve(self, nbytes):
        """Makes sure the arena has ``nbytes`` free (one chunk made and
        exported now if not); returns the bytes of chunks made."""
        return self._c.arena_reserve(int(nbytes))

    @property
    def arena_mechanism(self):
        """How the arena's chunks are shared (``vmm``, ``pool``, ``legacy``)."""
        return self._c.arena_mechanism()

    def publish_set(self, name, members, stream=None):
        """Publishes ``members``, ``[(entry_name, ArenaBuffer, dtype,
        shape)]``, as one set ``name``: one entry, one message, no export,
        after the work queued so far on this device (the host waits for
        it), or, given ``stream`` (see :mod:`cuda_ipc.streams`), after the
        work queued on that stream (the device waits; the call does not)."""
        _sets.publish_set(self, name, members, stream)

    def update_set(self, name, stream=None):
        """Tells the subscribers of the set ``name`` that new contents are
        ready, after the work queued so far on this device or on ``stream``
        (as :meth:`publish_set`); returns the version (from 1)."""
        return self._c.update_set(name, _streams.stream_handle(stream))

    def unpublish_set(self, name, timeout=None):
        """Hides the set ``name`` and waits up to ``timeout`` seconds
        (``None``: for ever) until every lease on it is released."""
        _sets.unpublish_set(self, name, timeout)

    def publish_state_dict(self, name, state_dict, stream=None):
        """Publishes a state dict (names to torch tensors) as the set
        ``name``. Each tensor is copied once into a buffer of this
        publisher's arena (made contiguous), unless it is one already (a
        tensor this method returned, or a view of :meth:`alloc`): then it
        is published as it is. Returns a dict of the shared tensors: write
        into them (or ``model.load_state_dict(them, assign=True)`` and
        train) and call :meth:`update_state_dict` to publish the change.

        The set is ordered after PyTorch's current stream (or ``stream``,
        where the copies then run too), on the device: write the tensors
        there, or synchronise the streams you wrote them on first."""
        return _sets.publish_state_dict(self, name, state_dict, stream)

    def update_state_dict(self, name, state_dict=None, stream=None):
        """Publishes new values of the state dict ``name``: copies
        ``state_dict`` (same keys, dtypes and shapes) into the shared
        tensors, in place, or, without one, publishes what was written into
        them. Ordered after PyTorch's current stream (or ``stream``), on
        the device: the call does not wait for the GPU. Returns the version
        (from 1)."""
        if state_dict is None and stream is None and name in self._state_dicts:
            # A training loop's update (the tensors written in place) runs
            # with the CPU's caches cold after a step, where each Python
            # call costs microseconds: PyTorch's current stream and one call
            # into the extension, nothing else.
            return self._c.update_set(name, _streams.torch_current_if_loaded(self._c.device))
        return _sets.update_state_dict(self, name, state_dict, stream)

    def arena_stats(self):
        """The arena's accounting as a dict: ``chunks``, ``chunk_bytes``,
        ``idle_chunks``, ``buffers``, ``used_bytes``, ``requested_bytes``,
        ``leases``, ``held_by_leases_only``, ``pins``, ``chunks_created``,
        ``chunks_released``."""
        return self._c.arena_stats()

    def reap(self):
        """Lets go of the buffers of unpublished sets whose last lease has
        ended (the publisher also does at each of its arena calls); returns
        how many sets."""
        return self._c.reap()

    def retired_sets(self):
        """Unpublished sets still leased by a subscriber."""
        return self._c.retired_sets()

    def trim(self):
        """Releases the arena's chunks that hold no buffer and that no
        subscriber maps; returns the bytes released."""
        return self._c.trim()

    def leases(self):
        """The current leases: ``[{"lease", "name", "pid", "uid"}]``."""
        return self._c.leases()

    def ring(self, name, slots, slot_bytes, mechanism=None, fences_only=False):
        """A ring of ``slots`` buffers of ``slot_bytes`` each, as ``name``.

        Each frame records the ring's event and signals its slot's fence
        (where the publisher has fences), so every reader's ``sync`` is
        served. With ``fences_only=True`` it only signals the fence (one
        driver call less per frame): readers wait on the fence (``sync``
        ``"auto"``, ``"fence"`` or ``"host-fence"``), and one that asks for
        ``"event"`` is refused when it attaches. Raises ``Unavailable`` for
        a fences-only ring of a publisher without fences."""
        return RingPublisher(self._c.ring(name, slots, slot_bytes, mechanism, fences_only), self.device)

    def close(self):
        """Stops serving. Safe to call twice. Lets go of the publisher's
        torch pool (:func:`cuda_ipc.torch.shareable`): its tensors stay
        valid, and their segments go back to the arena as they are freed."""
        self._c.close()
        self._torch_pool = None

    def __exit__(self, *exc):
        self._torch_pool = None
        return self._c.__exit__(*exc)


def _raw_name(name, raw):
    """The descriptor name a ``raw`` view of ``name`` shows (bool -> u8,
    u16 -> i16, f8e4m3fn -> u8, ...: the library's table)."""
    return _dtypes.raw_name(name, raw)


class RingPublisher(_Owner):
    """The producer's side of a ring: ``slot = ring.acquire()``, fill
    ``ring.as_torch(slot, ...)``, ``ring.publish(slot)``."""

    __slots__ = ("device",)

    def __init__(self, core, device):
        super().__init__(core)
        self.device = device

    slots = property(lambda self: self._c.slots)

    def subscribers(self):
        """How many subscribers the ring has now."""
        return self._c.subscribers()

    def acquire(self, timeout=None):
        """Waits for a free slot; returns its index."""
        return self._c.acquire(timeout)

    def view(self, slot, dtype="u8", shape=None):
        return self._c.view(slot, dtype, shape)

    def as_torch(self, slot, dtype="u8", shape=None):
        """The acquired slot as a torch tensor of ``dtype`` and ``shape``."""
        dt = _dtypes.lookup(dtype)
        return _as_torch(lambda n, raw: self._c.view(slot, _raw_name(n, raw), shape), dt.name if dt else dtype)

    def publish(self, slot, extra=None, stream=None):
        """Publishes the filled slot; ``extra`` (a small dict) goes into the
        frame's notice. Returns the frame's sequence number. Ordered after
        the work queued so far on this device (the host waits for it), or,
        given ``stream`` (see :mod:`cuda_ipc.streams`), after the work
        queued on that stream (the device waits; the call does not)."""
        return self._c.publish(slot, extra, _streams.stream_handle(stream))

    def __exit__(self, *exc):
        return False


class Attachment(_Owner):
    """A buffer attached from a publisher: a lease and a mapping. Tensors
    and arrays made from it hold the lease too: it ends at :meth:`release`,
    or when this object and the last of them are gone (also when this
    process exits or is killed)."""

    name = property(lambda self: self._c.name)
    lease = property(lambda self: self._c.lease)
    ptr = property(lambda self: self._c.ptr)
    nbytes = property(lambda self: self._c.nbytes)
    dtype = property(lambda self: self._c.dtype)
    shape = property(lambda self: self._c.shape)
    device = property(lambda self: self._c.device)
    mechanism = property(lambda self: self._c.mechanism)
    descriptor = property(lambda self: self._c.descriptor)
    released = property(lambda self: self._c.released)
    read_only = property(lambda self: self._c.read_only,
                         doc="Whether the buffer is mapped read-only: writing through it fails.")

    def view(self, dtype=None, raw=False):
        return self._c.view(dtype, raw)

    def as_torch(self, dtype=None):
        """A torch tensor over the attached memory (zero copy); it holds the lease."""
        return _as_torch(self._c.view, self.dtype, dtype)

    def as_cupy(self, dtype=None):
        """A CuPy array over the attached memory (zero copy); it holds the lease."""
        return _as_cupy(self._c.view, self.dtype, self.device, dtype)

    def wait_update(self, timeout=None):
        """Waits for the publisher's next update; returns its version.
        Raises PeerGone when the publisher is gone or takes the buffer back."""
        return self._c.wait_update(timeout)

    def release(self):
        """Ends the lease now; raises InvalidInput while tensors made from
        it are alive (the lease then ends with the last of them)."""
        return self._c.release()


class Frame(_Owner):
    """One frame of a ring: the slot's memory until :meth:`ack` (or the end
    of a ``with`` block) hands it back to the producer."""

    slot = property(lambda self: self._c.slot)
    seq = property(lambda self: self._c.seq)
    notice = property(lambda self: self._c.notice)

    def view(self, dtype="u8", shape=None):
        return self._c.view(dtype, shape)

    def as_torch(self, dtype="u8", shape=None):
        """The slot as a torch tensor of ``dtype`` and ``shape`` (zero copy);
        valid until :meth:`ack`."""
        dt = _dtypes.lookup(dtype)
        return _as_torch(lambda n, raw: self._c.view(_raw_name(n, raw), shape), dt.name if dt else dtype)

    def ack(self):
        """Hands the slot back to the producer. Safe to call twice."""
        return self._c.ack()


class Ring(_Owner):
    """A subscription to a ring: ``for frame in ring`` yields :class:`Frame`
    objects until the publisher is gone; ``timeout`` bounds each wait."""

    name = property(lambda self: self._c.name)
    slots = property(lambda self: self._c.slots)
    uses_fences = property(lambda self: self._c.uses_fences,
                           doc="Whether frames are waited for through the publisher's fence (else its event).")
    spins = property(lambda self: self._c.spins,
                     doc="Whether iteration spins for the next frame before it sleeps: when frames are "
                         "waited for on the fence from the host (sync=\"host-fence\"), where spinning "
                         "costs no context switch.")

    @property
    def timeout(self):
        return self._c.timeout

    @timeout.setter
    def timeout(self, seconds):
        self._c.timeout = seconds

    def next(self, timeout=None):
        """The next frame within ``timeout`` seconds (``None``: for ever)."""
        return Frame(self._c.next(timeout))

    def __iter__(self):
        return self

    def __next__(self):
        return Frame(self._c.__next__())

    def release(self):
        """Ends the subscription."""
        return self._c.release()


class Subscriber(_Owner):
    """Connects to a publisher (a name or a socket path) and attaches to
    what it publishes; requests time out after ``timeout`` seconds. With
    ``read_only``, everything it attaches is mapped read-only (VMM memory
    only; see the module documentation).

    ``reconnect``: whether it connects again when the publisher's process
    ends. ``None`` (the default): when the publisher says another process
    serves after it, as the weight service under its keeper does; its next
    call (an attach, a wait for an update, a release, a call) then
    connects again within ``timeout`` and takes back the leases of what it
    holds, its tensors staying where they are. ``False``: never (a call
    after the publisher's end raises :class:`cuda_ipc.PeerGone`);
    ``True``: always."""

    def __init__(self, endpoint, *, device=0, timeout=5.0, allow_uids=(), read_only=False,
                 reconnect=None):
        if reconnect is not None and not isinstance(reconnect, bool):
            raise InvalidInput(f"reconnect must be None, True or False, not {reconnect!r}")
        super().__init__(_core.Subscriber(str(endpoint), device=device, timeout=timeout,
                                          allow_uids=list(allow_uids), read_only=bool(read_only),
                                          reconnect=reconnect))

    def list(self):
        """The names published now."""
        return self._c.list()

    def call(self, method, body=None, timeout=None):
        """Calls ``method`` of the publisher's call handler (a service's,
        :mod:`cuda_ipc.service`) with ``body`` (a dict) on this
        subscriber's connection; returns the answer (a dict). What the
        call makes the connection hold (a write session) ends with it."""
        import json

        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise InvalidInput(f"body must be a dict, not {type(body).__name__}")
        return json.loads(self._c.call(method, json.dumps(body), timeout))

    def save_set(self, name, path, *, overwrite=False, streams=None, staging=None):
        """Saves the current version of a service's set ``name`` as a
        safetensors file at ``path`` from this process (see
        :func:`cuda_ipc.service.save`); returns what it did (a dict)."""
        import json
        import os

        return json.loads(self._c.save_set(name, os.fspath(path), overwrite=overwrite,
                                           streams=streams, staging=staging))

    def is_alive(self):
        """Whether the publisher is still there (it does not connect again)."""
        return self._c.is_alive()

    reconnects = property(lambda self: self._c.reconnects,
                          doc="Whether it connects again when the publisher's process ends.")

    def reconnect(self):
        """Makes sure the connection is up: connects again if the
        publisher's process ended (whatever ``reconnect`` said), takes back
        the leases of the chunks and sets it holds where the publisher
        still serves them, and returns what it did (a dict: ``connected``;
        ``retaken``, the sets whose lease is back; ``old_versions``, the
        sets it holds an older version of than the one served now, still
        mapped: attach them again; ``not_retaken``, ``[set, why]`` pairs;
        ``chunks``, ``chunks_unleased``). Nothing is mapped again."""
        import json

        return json.loads(self._c.reconnect())

    def step_aside(self, name):
        """Tells the service this subscriber stepped aside from its set
        ``name`` for a write in place (its mappings must sleep already:
        :meth:`sleep`); after a reconnect it is aside on the new
        connection too, until :meth:`come_back`. Returns the answer (a
        dict)."""
        import json

        return json.loads(self._c.step_aside(name))

    def come_back(self, name, *, next=False, timeout=600.0):
        """Waits up to ``timeout`` seconds for the in-place write of the
        service's set ``name`` to end (with ``next``: for the next version
        to be committed), then wakes every mapping. Returns the answer (a
        dict)."""
        import json

        try:
            return json.loads(self._c.come_back(name, next=bool(next), timeout=timeout))
        finally:
            self._watch_sleep()

    opens = property(lambda self: self._c.opens, doc="Mappings opened (cache misses).")

    def attach(self, name):
        """Attaches to ``name``; returns an :class:`Attachment`."""
        return Attachment(self._c.attach(name))

    def attach_set(self, name, *, read_only=False):
        """Attaches the set ``name``; returns a :class:`cuda_ipc.sets.SetAttachment`.
        With ``read_only`` its chunks are mapped read-only (as they are
        anyway when the publisher has ``read_only_readers``)."""
        return _sets.SetAttachment(self._c.attach_set(name, read_only=bool(read_only)))

    def attach_state_dict(self, name, *, read_only=False):
        """Attaches the set ``name`` as a :class:`cuda_ipc.sets.StateDict`:
        a dict of zero-copy torch tensors (dtypes and shapes as published)
        with ``wait_update`` and ``release``. With ``read_only`` the
        tensors' memory is mapped read-only: a kernel that writes to them
        fails and the publisher's bytes do not change (``sd.read_only``
        says how it was mapped; the tensors themselves carry no flag)."""
        return _sets.attach_state_dict(self._c.attach_set(name, read_only=bool(read_only)))

    def drop_idle_mappings(self):
        """Unmaps the cached arena chunks that no set holds any more."""
        self._c.drop_idle_mappings()

    def cached_mappings(self):
        """``(count, bytes)`` of the arena chunks kept mapped."""
        return self._c.cached_mappings()

    def sleep(self, *, unchecked=False):
        """Unmaps everything this subscriber holds, keeping the addresses
        (reserved, so nothing else lands there) and the leases; waits first
        for every stream of the device (PyTorch's too). Until :meth:`wake`,
        an attach that would hand out sleeping memory raises. VMM memory
        only (legacy or pool mappings: ``Unsupported``, nothing unmapped).
        Returns ``(mappings, bytes)`` put to sleep.

        A kernel or copy on sleeping memory faults and poisons this
        process's CUDA context, so the sleep is refused
        (:class:`cuda_ipc.InvalidInput`, nothing unmapped) while tensors,
        state dicts, attachments, views or rings of this subscriber are
        alive: release them first (the chunks of released sets stay mapped
        for reuse; they sleep, and an attach after :meth:`wake` finds them
        at the same addresses). ``unchecked=True`` sleeps although they are
        alive, to keep them (and CUDA graphs captured over them) across the
        sleep at the same addresses: the caller then promises that nothing
        touches them (no kernel, copy or graph replay, on any thread) until
        :meth:`wake` returns. Until then, a ``torch.nn.Module`` called on
        the sleeping memory (its parameters, buffers or tensor arguments)
        raises :class:`cuda_ipc.Asleep` before queuing anything
        (:mod:`cuda_ipc.asleep`); other uses are not checked."""
        try:
            return self._c.sleep(unchecked=bool(unchecked))
        finally:
            self._watch_sleep()

    def wake(self):
        """Maps everything :meth:`sleep` unmapped again at the same
        addresses (CUDA graphs captured over the tensors stay valid).
        Returns ``(mappings, bytes)`` woken."""
        try:
            return self._c.wake()
        finally:
            self._watch_sleep()

    def sleeping_ranges(self):
        """``[(base, bytes), ...]`` of the mappings asleep now, in address
        order: what a use before :meth:`wake` would fault on."""
        return self._c.sleeping_ranges()

    def _watch_sleep(self):
        """Module calls check what sleeps now (:mod:`cuda_ipc.asleep`)."""
        from . import asleep as _asleep

        _asleep.watch(self, self.sleeping_ranges())

    asleep = property(lambda self: self._c.asleep, doc="Whether any of its mappings sleeps.")

    def attach_ring(self, name, timeout=None):
        """Subscribes to the ring ``name``; returns a :class:`Ring`."""
        r = Ring(self._c.attach_ring(name))
        r.timeout = timeout
        return r

    def close(self):
        """Lets go of this subscriber. Attachments, state dicts and tensors
        still alive keep its connection (and their leases) until the last
        of them is gone: the publisher never reuses memory they hold. Safe
        to call twice."""
        self._c.close()
