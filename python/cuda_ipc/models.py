"""A transformers model ready in one call from a state dict of shared
tensors: a weight service's set, or a publisher's state dict.

::

    from cuda_ipc import models, service

    reader = service.Reader("cuda-ipc")
    model = models.from_service(reader, "model", "/models/qwen3")   # config.json read from here
    out = model.generate(ids, max_new_tokens=8)

    sd = cuda_ipc.Subscriber("trainer").attach_state_dict("model")
    model = models.from_state_dict(config, sd)                        # a config object, or a folder

What it does, without copying a parameter:

1. builds the model on the ``meta`` device from its config (no memory),
   in the state dict's floating-point dtype;
2. assigns every tensor of the state dict in place of the parameter or
   buffer of that name (``load_state_dict(assign=True)``): the model's
   weights *are* the shared memory (read-only where the set is);
3. ties the weights the config ties (``tie_weights``: ``lm_head.weight``
   and the input embeddings, which checkpoints store once);
4. makes the buffers that are not in a state dict (rotary tables, an
   embedding's scale: made from the config) again on the device, by
   building their module there, or the model small (one layer) there;
5. refuses a state dict that lacks a parameter, or has a tensor the model
   does not, naming them; puts the model in ``eval`` mode.

The time it takes is in ``model.cuda_ipc_ready``: ``{"meta_ms": ..., "assign_ms": ...}``
(building on ``meta`` includes transformers' first import of the model's
modules, which a long-running engine pays once).
"""

import os
import re
import time

from .errors import InvalidInput

__all__ = ["from_state_dict", "from_service"]


def __dir__():
    return sorted(__all__)


def _config(config):
    """A transformers config: given, or read from a model folder."""
    if isinstance(config, (str, os.PathLike)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(os.fspath(config))
    if not hasattr(config, "to_dict"):
        raise InvalidInput(f"config must be a transformers config or a model folder, not {config!r}")
    return config


def _dtype(torch, state_dict):
    """The floating-point dtype of the state dict's tensors (the first)."""
    for t in state_dict.values():
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def _device(state_dict):
    for t in state_dict.values():
        return t.device
    raise InvalidInput("the state dict holds no tensor")


def _build(torch, cfg, dtype, model_class):
    if model_class is None:
        from transformers import AutoModelForCausalLM

        make = AutoModelForCausalLM.from_config
    else:
        make = model_class._from_config
    with torch.device("meta"):
        try:
            return make(cfg, dtype=dtype)
        except TypeError:  # transformers before `dtype`
            return make(cfg, torch_dtype=dtype)


def _buffers_again(model, device, dtype):
    """Makes again, on `device`, every buffer left on `meta` (one outside
    the state dict: a rotary embedding's table, an embedding's scale).
    A module built from the config alone (rotary embeddings) is built again
    there; any other buffer is taken from the same model made small on the
    device (one layer, a small vocabulary), by name, where its shape is the
    same (buffers are made from the config, not from the layer count or
    the vocabulary)."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        parent, _, child = name.rpartition(".")
        import torch

        try:
            with torch.device(device):
                fresh = type(module)(config=model.config)
        except TypeError:
            continue  # taken from the small model below
        setattr(model.get_submodule(parent) if parent else model, child, fresh)
    left = [(n, b) for n, b in model.named_buffers() if b.is_meta]
    if not left:
        return
    small = _small_buffers(model, device, dtype)
    for full, buffer in left:
        key = re.sub(r"(\.layers\.)\d+(\.)", r"\g<1>0\2", full)
        value = small.get(key)
        if value is None or value.shape != buffer.shape:
            raise InvalidInput(f"buffer {full} is not in the state dict and cannot be made again from the config")
        owner, _, bname = full.rpartition(".")
        model.get_submodule(owner)._buffers[bname] = value


def _small_buffers(model, device, dtype):
    """The buffers of the model made small on `device`."""
    import copy

    import torch

    cfg = copy.deepcopy(model.config)
    for attr in ("num_hidden_layers", "num_layers", "n_layer"):
        if isinstance(getattr(cfg, attr, None), int):
            setattr(cfg, attr, 1)
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:1]
    vocab = getattr(cfg, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 256:
        cfg.vocab_size = 256
        for tok in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(getattr(cfg, tok, None), int) and getattr(cfg, tok) >= 256:
                setattr(cfg, tok, None)
    with torch.device(device):
        try:
            small = type(model)._from_config(cfg, dtype=dtype)
        except TypeError:
            small = type(model)._from_config(cfg, torch_dtype=dtype)
    return dict(small.named_buffers())


def from_state_dict(config, state_dict, *, model_class=None):
    """The transformers model of ``config`` (a config object or a model
    folder) whose weights are ``state_dict``'s tensors, without a copy (see
    the module docs). ``model_class``: the model's class (default: the
    config's causal LM, ``AutoModelForCausalLM``)."""
    if not hasattr(state_dict, "items") or not len(state_dict):
        raise InvalidInput("state_dict must be a non-empty mapping of names to tensors")
    import torch

    cfg = _config(config)
    device = _device(state_dict)
    t0 = time.perf_counter()
    model = _build(torch, cfg, _dtype(torch, state_dict), model_class)
    t1 = time.perf_counter()
    result = model.load_state_dict(dict(state_dict.items()), strict=False, assign=True)
    if result.unexpected_keys:
        raise InvalidInput(f"the state dict has tensors the model does not: {sorted(result.unexpected_keys)[:8]}")
    model.tie_weights()
    missing = sorted(n for n, p in model.named_parameters() if p.is_meta)
    if missing:
        raise InvalidInput(f"the state dict lacks parameters of the model: {missing[:8]}")
    _buffers_again(model, device, _dtype(torch, state_dict))
    model.eval()
    t2 = time.perf_counter()
    model.cuda_ipc_ready = {"meta_ms": (t1 - t0) * 1e3, "assign_ms": (t2 - t1) * 1e3}
    return model


def from_service(reader, set, config, *, model_class=None):
    """The model of ``config`` (a config object or a model folder) from the
    set ``set`` of the service ``reader`` reads (a
    :class:`cuda_ipc.service.Reader`): its current version attached
    read-only, assigned without a copy. The state dict stays attached while
    the model's tensors live; ``model.cuda_ipc_state_dict`` is it (release
    it, or ``wait_update`` on it, as any)."""
    if not hasattr(reader, "attach_state_dict"):
        raise InvalidInput(f"reader must be a cuda_ipc.service.Reader, not {reader!r}")
    sd = reader.attach_state_dict(set)
    model = from_state_dict(config, sd, model_class=model_class)
    model.cuda_ipc_state_dict = sd
    return model
