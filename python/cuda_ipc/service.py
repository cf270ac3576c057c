"""The weight service from Python (``cuda-ipc serve --service``): readers,
writers and the admin functions.

A service owns the device memory of its sets; readers map them read-only,
one writer per set at a time writes a new version and commits it.

::

    from cuda_ipc import service

    service.load("weights", "/models/qwen", set="model")   # the service loads it
    with service.Reader("weights") as reader:
        sd = reader.attach_state_dict("model")               # read-only tensors
        model.load_state_dict(sd, assign=True)

    # A trainer: writes every tensor of the next version, then commits.
    with service.Writer("weights", "model") as w:
        for name, t in w.state_dict.items():
            t.copy_(trained[name])
    # leaving the block commits; an exception aborts (readers never see it)

Readers move to a new version when they ask: ``sd.wait_update()`` returns
when a writer commits; attach the set again for the new version and
release the old one. A writer's session is its connection: a writer that
exits or is killed aborts, and readers stay on the last committed version.
A writer's staging version starts with undefined contents: write every
byte. Every error is a :class:`cuda_ipc.errors.CudaIpcError`; the
service's refusals are :class:`cuda_ipc.errors.ServiceError` with a
``code`` (``writing``, naming the writer that holds the set;
``over_quota``; ``not_found``; ``leased``; ...).

Run on an H200 (docs/SERVICE.md has the figures and targets).
"""

import json
import os

from . import _core
from .channel import Subscriber
from .errors import CudaIpcError, InvalidInput

__all__ = ["Reader", "Writer", "load", "save", "ls", "stats", "drop", "call", "shard_name"]


def __dir__():
    # dir() shows the module's API, not its imports and helpers.
    return sorted(__all__)

# How long a writer's calls wait: open_write allocates the staging version.
_WRITE_TIMEOUT = 120.0


def _name(what, value):
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{what} must be a non-empty string, not {value!r}")
    return value


def _service(service):
    if isinstance(service, os.PathLike):
        service = os.fspath(service)
    return _name("service", service)


def call(service, method, body=None, *, timeout=5.0, allow_uids=()):
    """Calls ``method`` of the service ``service`` (a name or a socket
    path) with ``body`` (a dict; ``{}`` by default) on a connection of its
    own; returns the answer (a dict)."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise InvalidInput(f"body must be a dict, not {type(body).__name__}")
    text = _core.service_call(_service(service), _name("method", method), json.dumps(body),
                              timeout=timeout, allow_uids=list(allow_uids))
    return json.loads(text)


def load(service, path, *, set="model", streams=None, staging=None, tp=None, tp_rules=(),
         timeout=600.0, allow_uids=()):
    """Has the service load the safetensors checkpoint at ``path`` (a file,
    a sharded checkpoint's index or a directory, made absolute here) as
    set ``set``, counted against the caller's quota; returns the answer
    (``set``, ``version``, ``tensors``, ``bytes``, ``load_s``,
    ``gb_per_s``, ...).

    With ``tp=(rank, world)``, loads tensor-parallel rank ``rank``'s shard
    of every tensor into the set ``shard_name(set, rank, world)``: each
    tensor split along the dimension the rules give (``tp_rules``, a list
    of ``(pattern, dim)`` pairs, ``dim`` ``None`` to replicate, tried in
    order before the built-in rules for Llama, Qwen and Mistral names;
    docs/SERVICE.md, "Tensor parallel")."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    path = os.path.abspath(_name("path", path))
    body = {"set": _name("set", set), "path": path}
    if streams is not None:
        body["streams"] = _count("streams", streams)
    if staging is not None:
        body["staging"] = _count("staging", staging)
    rules = _tp_rules(tp_rules)
    if tp is not None:
        rank, world = _tp(tp)
        shard_name(set, rank, world)
        body["tp"] = {"rank": rank, "world": world}
        if rules:
            body["tp"]["rules"] = rules
    elif rules:
        raise InvalidInput("tp_rules need tp=(rank, world)")
    return call(service, "load", body, timeout=timeout, allow_uids=allow_uids)


# The most ranks a shard set names, rules a load takes and bytes a rule's
# pattern has (the service's limits).
_MAX_TP_WORLD = 64
_MAX_TP_RULES = 64
_MAX_TP_PATTERN = 256


def shard_name(set, rank, world):
    """The name of tensor-parallel rank ``rank``'s shard of set ``set``
    among ``world`` ranks: ``f"{set}.tp{rank}-of-{world}"``, the set a
    ``load(..., tp=(rank, world))`` fills (``world`` from 1 to 64, ``rank``
    below it)."""
    _name("set", set)
    for what, n in (("rank", rank), ("world", world)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise InvalidInput(f"tensor-parallel {what} must be an int, not {n!r}")
    if not 1 <= world <= _MAX_TP_WORLD:
        raise InvalidInput(f"tensor-parallel world: {world} ranks; give 1 to {_MAX_TP_WORLD}")
    if not 0 <= rank < world:
        raise InvalidInput(
            f"tensor-parallel rank {rank} of {world}: ranks count from 0 to {world - 1}")
    return f"{set}.tp{rank}-of-{world}"


def _tp(tp):
    if isinstance(tp, (str, bytes)) or not hasattr(tp, "__len__") or len(tp) != 2:
        raise InvalidInput(f"tp must be a pair (rank, world), not {tp!r}")
    return tuple(tp)


def _tp_rules(rules):
    if isinstance(rules, (str, bytes, dict)):
        raise InvalidInput(f"tp_rules must be a list of (pattern, dim) pairs, not {rules!r}")
    out = []
    for rule in rules:
        if isinstance(rule, (str, bytes)) or not hasattr(rule, "__len__") or len(rule) != 2:
            raise InvalidInput(f"a tp rule must be a pair (pattern, dim or None), not {rule!r}")
        pattern, dim = rule
        if not isinstance(pattern, str) or not 1 <= len(pattern.encode()) <= _MAX_TP_PATTERN:
            raise InvalidInput(
                f"a tp rule's pattern must be a string of 1 to {_MAX_TP_PATTERN} bytes, "
                f"not {pattern!r}")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 0):
            raise InvalidInput(
                f"a tp rule's dim must be a dimension (an int from 0) or None, not {dim!r}")
        out.append([pattern, dim])
    if len(out) > _MAX_TP_RULES:
        raise InvalidInput(f"{len(out)} tp rules, more than {_MAX_TP_RULES}")
    return out


def save(service, path, *, set="model", overwrite=False, streams=None, staging=None, device=0,
         timeout=5.0, allow_uids=()):
    """Saves the current version of set ``set`` as a safetensors file at
    ``path`` (a directory: the file named after the set in it, as
    ``cuda-ipc serve --service --restore DIR`` reads it back), from this
    process, while the service goes on serving it and a writer goes on
    writing its next version; returns what it did (``version``, ``path``,
    ``bytes``, ``save_s``, ``gb_per_s``, ...). An existing file is replaced
    only with ``overwrite``; tied tensors are left out, as safetensors
    files carry each tensor's bytes once."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    path = _name("path", path)
    if not isinstance(overwrite, bool):
        raise InvalidInput(f"overwrite must be a bool, not {overwrite!r}")
    if streams is not None:
        streams = _count("streams", streams)
    if staging is not None:
        staging = _count("staging", staging)
    with Reader(service, device=device, timeout=timeout, allow_uids=allow_uids) as reader:
        return reader.save(set, path, overwrite=overwrite, streams=streams, staging=staging)


def _count(what, n):
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise InvalidInput(f"{what} must be a positive int, not {n!r}")
    return n


def ls(service, *, timeout=5.0, allow_uids=()):
    """The sets the service holds: a list of dicts (``name``, ``bytes``,
    ``version``, ``owner_uid``, ``leases``, ``state`` (``committed`` or
    ``writing``), ``writer``, ``restarts`` (how many restarts of the serving
    process this version was kept through), ...)."""
    return call(service, "ls", {}, timeout=timeout, allow_uids=allow_uids)["sets"]


def stats(service, *, timeout=5.0, allow_uids=()):
    """Per-uid use against quotas, totals and the device's memory (a dict)."""
    return call(service, "stats", {}, timeout=timeout, allow_uids=allow_uids)


def drop(service, set, force=False, *, timeout=5.0, allow_uids=()):
    """Drops set ``set`` (refused while readers hold it, unless ``force``:
    they keep what they mapped); returns the answer."""
    if not isinstance(force, bool):
        raise InvalidInput(f"force must be a bool, not {force!r}")
    return call(service, "drop", {"set": _name("set", set), "force": force},
                timeout=timeout, allow_uids=allow_uids)


class Reader:
    """A reader of the service ``service``: a :class:`cuda_ipc.Subscriber`
    that maps everything read-only (a kernel that writes to the tensors
    fails; the service's bytes do not change).

    When the serving process dies and its keeper starts the next one (the
    default ``cuda-ipc serve --service``), the reader's tensors stay valid
    and its next call (an attach, ``wait_update``, ``step_aside``,
    ``come_back``, a release, :meth:`reconnect`) connects again within
    ``timeout`` seconds and takes its leases back: ``ls`` shows it again,
    and a writer in place waits for it as before. A set whose version the
    new process no longer serves stays mapped as it is; its
    ``wait_update()`` returns at once (attach it again). ``reconnect=False``
    never connects again (a call then raises :class:`cuda_ipc.PeerGone`);
    ``True`` always tries, even to a service that does not say it
    restarts."""

    def __init__(self, service, *, device=0, timeout=5.0, allow_uids=(), reconnect=None):
        self.subscriber = Subscriber(_service(service), device=device, timeout=timeout,
                                     allow_uids=allow_uids, read_only=True, reconnect=reconnect)

    def reconnect(self):
        """Connects again now if the serving process ended, and takes back
        the leases of what this reader holds; returns what it did (see
        :meth:`cuda_ipc.Subscriber.reconnect`: ``old_versions`` names the
        sets held at a version no longer served). Raises
        :class:`cuda_ipc.errors.CudaIpcError` naming the socket when no
        service answers within the reader's timeout."""
        return self.subscriber.reconnect()

    def attach_state_dict(self, set):
        """The current version of set ``set`` as a
        :class:`cuda_ipc.sets.StateDict` of read-only tensors;
        ``wait_update()`` on it returns when a writer commits a new one."""
        return self.subscriber.attach_state_dict(_name("set", set), read_only=True)

    def step_aside(self, set, *, unchecked=False):
        """Steps aside from set ``set`` for a write in place: puts every
        mapping to sleep (:meth:`sleep`; ``unchecked=True`` keeps tensors,
        a model's parameters and CUDA graphs over them: run nothing on them
        until :meth:`come_back`), then tells the service. Returns its
        answer (``version``, ``writing_in_place``)."""
        set = _name("set", set)
        self.sleep(unchecked=unchecked)
        return self.subscriber.step_aside(set)

    def come_back(self, set, *, next=False, timeout=600.0):
        """Waits up to ``timeout`` seconds for the in-place write of
        ``set`` to end (with ``next``: for the next version to be
        committed, whether or not its writer has started: what a reader
        that steps aside ahead of an expected update wants), then wakes
        every mapping at the address it had: the tensors hold the new
        version. Returns the answer (``version``). A write cut short raises
        ``ServiceError`` with code ``torn`` and the mappings stay asleep
        (attach again once a write commits); so does a ``timeout`` (call
        again)."""
        set = _name("set", set)
        if not isinstance(next, bool):
            raise InvalidInput(f"next must be a bool, not {next!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= 600:
            raise InvalidInput(f"timeout must be seconds from 0 to 600, not {timeout!r}")
        return self.subscriber.come_back(set, next=next, timeout=timeout)

    def save(self, set, path, *, overwrite=False, streams=None, staging=None):
        """Saves the current version of set ``set`` as a safetensors file
        (see :func:`save`); returns what it did (a dict)."""
        return self.subscriber.save_set(_name("set", set), path, overwrite=overwrite,
                                        streams=streams, staging=staging)

    def sleep(self, *, unchecked=False):
        """Unmaps everything, keeping the addresses (see
        :meth:`cuda_ipc.Subscriber.sleep`: refused while its state dicts
        or tensors are alive, unless ``unchecked``)."""
        return self.subscriber.sleep(unchecked=unchecked)

    def wake(self):
        """Maps everything again at the same addresses."""
        return self.subscriber.wake()

    asleep = property(lambda self: self.subscriber.asleep, doc="Whether it sleeps.")

    def close(self):
        """Disconnects (tensors still alive keep their leases)."""
        self.subscriber.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class Writer:
    """A write session on set ``set`` of the service ``service``, as a
    context manager: entering opens it (one writer per set: another
    writer's session is refused, ``ServiceError`` with code ``writing``
    naming it) and attaches the staging version read-write as
    :attr:`state_dict`; leaving commits, or aborts on an exception.

    For an existing set the staging version has its layout; for a new set
    give ``layout``: a dict of name to a tensor (its dtype and shape are
    taken) or to ``(dtype, shape)`` (a descriptor or PyTorch dtype name).
    The staging contents start undefined: write every tensor (``copy_``,
    ``load_state_dict``).

    With ``in_place=True`` (an existing set) there is no second copy: the
    staging state dict is the current version's own memory. The service
    first waits up to ``wait`` seconds for every reader to step aside
    (:meth:`Reader.step_aside`) and refuses new attaches until the commit;
    a reader that does not step aside in time makes the open fail
    (``ServiceError`` with code ``readers_not_aside``, naming it; nothing
    written). Readers come back at the same addresses
    (:meth:`Reader.come_back`). An abort, or this process's end before the
    commit, leaves the set torn (attaches refused with code ``torn``)
    until a write commits: write in place only what you can write again."""

    def __init__(self, service, set, *, layout=None, in_place=False, wait=10.0, device=0,
                 timeout=5.0, allow_uids=()):
        self.set = _name("set", set)
        if not isinstance(in_place, bool):
            raise InvalidInput(f"in_place must be a bool, not {in_place!r}")
        if in_place and layout is not None:
            raise InvalidInput("an in-place write is of an existing set: give no layout")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 600:
            raise InvalidInput(f"wait must be seconds from 0 to 600, not {wait!r}")
        self.in_place = in_place
        self._wait_ms = int(wait * 1000)
        self._layout = _layout(layout) if layout is not None else None
        self._device = device
        self.subscriber = Subscriber(_service(service), device=device, timeout=timeout,
                                     allow_uids=allow_uids)
        self.opened = None
        self.state_dict = None
        self._done = False

    def open(self):
        """Opens the session and attaches the staging version; returns its
        state dict. After a commit or an abort it opens the next session on
        the same connection (a trainer's loop: no new connection, and the
        staging version's chunks stay mapped from one session to the
        next)."""
        if self.opened is not None and not self._done:
            raise InvalidInput(f"the write of {self.set!r} is open already")
        self._done = False
        body = {"set": self.set}
        if self._layout is not None:
            body["layout"] = self._layout
        if self.in_place:
            body.update(in_place=True, wait_ms=self._wait_ms)
        self.opened = self.subscriber.call("open_write", body, _WRITE_TIMEOUT + self._wait_ms / 1000)
        try:
            self.state_dict = self.subscriber.attach_state_dict(self.opened["staging"])
        except BaseException:
            self._end("abort")
            raise
        return self.state_dict

    version = property(lambda self: self.opened and self.opened["version"],
                       doc="The version a commit makes (``None`` before :meth:`open`).")

    def commit(self):
        """Waits for every stream of the device (PyTorch's too), lets go of
        the staging tensors and commits: readers get an update and new
        attaches get this version. Returns the answer (``version``,
        ``retired_version``, ``readers_told``)."""
        if self.state_dict is None:
            raise InvalidInput(f"the write of {self.set!r} is not open")
        _synchronize(self._device)
        body = {"set": self.set, "layout_hash": self.state_dict.attachment.layout_hash}
        self._let_go()
        return self._end("commit", body)

    def abort(self):
        """Discards the staging version; readers stay on the current one."""
        if self.opened is None:
            raise InvalidInput(f"the write of {self.set!r} is not open")
        self._let_go()
        return self._end("abort")

    def _let_go(self):
        sd, self.state_dict = self.state_dict, None
        if sd is not None:
            try:
                sd.release()
            except CudaIpcError:
                # Tensors of it live on (a model's after assign=True): the
                # mapping stays until they go; they must not be written.
                pass

    def _end(self, method, body=None):
        self._done = True
        return self.subscriber.call(method, body or {"set": self.set}, _WRITE_TIMEOUT)

    def close(self):
        """Disconnects; a session still open ends as an abort."""
        self.subscriber.close()

    def __enter__(self):
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if not self._done and self.opened is not None:
                if exc_type is None:
                    self.commit()
                else:
                    self.abort()
        finally:
            self.close()
        return False


def _layout(layout):
    """A new set's layout as the service takes it: a list of ``{name,
    dtype, shape}``."""
    from . import dtypes as _dtypes

    if not isinstance(layout, dict) or not layout:
        raise InvalidInput("layout must be a non-empty dict of name to a tensor or (dtype, shape)")
    out = []
    for name, spec in layout.items():
        _name("a layout's tensor name", name)
        if hasattr(spec, "dtype") and hasattr(spec, "shape"):
            dtype, shape = spec.dtype, tuple(spec.shape)
        elif isinstance(spec, (tuple, list)) and len(spec) == 2:
            dtype, shape = spec
        else:
            raise InvalidInput(f"layout[{name!r}] must be a tensor or (dtype, shape), not {spec!r}")
        d = _dtypes.lookup(dtype)
        if d is None:
            raise InvalidInput(f"layout[{name!r}]: unknown dtype {dtype!r}")
        if isinstance(shape, int) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                             for n in shape):
            raise InvalidInput(f"layout[{name!r}]: shape must be positive ints, not {shape!r}")
        out.append({"name": name, "dtype": d.name, "shape": [int(n) for n in shape]})
    return out


def _synchronize(device):
    """Waits for PyTorch's streams on ``device`` if PyTorch is loaded."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
