"""A full-weight reload into a live vLLM model that either completes or leaves the model exactly as it was, on top
of vLLM's layerwise reload (vllm/model_executor/model_loader/reload: initialize_layerwise_reload parks every layer on
the meta device and buffers each layer's weights until the layer is complete, then loads, post-processes and copies
them into the layer's kernel tensors; finalize_layerwise_reload handles the rest). vLLM has no way back: a load that
raises half-way leaves the unfinished layers on the meta device ("Cannot copy out of meta tensor" on the next
request) and its per-layer state holding the buffered tensors, so the next reload fails with the same error.

    check_loadable(model, weights, what)    a dry run of model.load_weights with every parameter on the meta device
                                            (vLLM's own loaders, the parameters' shapes as the model was built):
                                            ValueError naming a tensor the model lacks, one whose shape does not
                                            load, one of an integer dtype for a floating parameter, or a parameter
                                            the weights leave (partly) unloaded. Nothing of the model is touched.
    reload(model, model_config, weights)    snapshot, vLLM's layerwise reload, `after()`; on any exception vLLM's
                                            layerwise state is reset and the snapshot put back, then the error raised
    txn = Transaction(model) ... txn.rollback()     the same for a reload streamed in several load_weights calls

The snapshot holds a host copy of every parameter and buffer (the model's bytes once, for the duration of the
reload) and a shallow copy of every module's attributes: a reload changes the kernel tensors in place and replaces
derived state (the CPU GEMM handles, MLA's absorbed matrices) with new objects, so the copy of the values and the old
references restore it exactly.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

import torch


def _layerwise():
    from vllm.model_executor.model_loader.reload import layerwise, meta, utils

    return layerwise, meta, utils


def _meta_model(model: torch.nn.Module, counts: dict, dtype_errors: list) -> list:
    """Every parameter (and every buffer recorded for reloading) of `model` replaced by a meta tensor in model format
    (vLLM's restore metadata where recorded), each parameter's weight loader counting the elements it copies into
    counts[key] = [copied, needed, parameter name]; returns what _put_back puts back (module, its attributes,
    parameters, buffers, non-persistent buffer names)."""
    layerwise, meta, utils = _layerwise()
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    saved, memo = [], {}
    prefix = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}

    def counting(key, m):
        orig = layerwise._get_original_loader(m)
        sig = inspect.signature(orig)

        def loader(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            w = next((v for k, v in bound.arguments.items() if k != "param" and isinstance(v, torch.Tensor)), None)
            if w is not None and w.dtype.is_floating_point != m.dtype.is_floating_point:
                dtype_errors.append(f"dtype {w.dtype} into the {m.dtype} parameter {counts[key][2]!r}")
            n, ret = meta.get_numel_loaded(orig, bound)
            counts[key][0] += n
            return ret
        return loader

    def to_meta(key, src, layer, name, is_param, required=True):
        if key not in memo:
            m = restore_layer_refs(meta.to_meta_tensor(src), layer)     # a copy: the recorded metadata is unchanged
            if is_param:
                full = f"{prefix.get(id(layer), '')}.{name}".lstrip(".")
                counts[key] = [0, utils.get_tensor_load_numel(m) if required else 0, full]
                m.weight_loader = counting(key, m)
            memo[key] = m
        return memo[key]

    for layer in model.modules():
        saved.append((layer, dict(layer.__dict__), dict(layer._parameters), dict(layer._buffers),
                      set(layer._non_persistent_buffers_set)))
    for layer, _, params, buffers, _ in saved:
        if layer.__class__.__name__ in meta.SKIP_MODULES:
            continue
        info = layerwise.LAYERWISE_INFO.get(layer)
        rec_p, rec_b = info.restore_metadata if info is not None else ({}, {})
        for name in set(params) | set(rec_p):
            cur, src = params.get(name), rec_p.get(name, params.get(name))
            if src is None:
                continue
            layer.__dict__.pop(name, None)
            key = id(cur) if cur is not None else (id(layer), name)
            # a parameter made after the model was built (vLLM's post-load processing) need not be loaded
            layer._parameters[name] = to_meta(key, src, layer, name, True, info is None or name in rec_p)
        for name, src in rec_b.items():
            cur = buffers.get(name)
            layer.__dict__.pop(name, None)
            key = id(cur) if cur is not None else (id(layer), name)
            layer._buffers[name] = to_meta(key, src, layer, name, False)
    return saved


def _put_back(saved: list) -> None:
    for layer, attrs, params, buffers, non_persistent in saved:
        layer.__dict__.clear()
        layer.__dict__.update(attrs)
        layer._parameters.clear()
        layer._parameters.update(params)
        layer._buffers.clear()
        layer._buffers.update(buffers)
        layer._non_persistent_buffers_set = non_persistent


def check_loadable(model: torch.nn.Module, weights: list, what: str) -> None:
    """A dry run of `model.load_weights(weights)` on the meta device (weights: [(checkpoint name, tensor)]): every
    name loads, with a shape the parameter takes and a floating dtype for a floating parameter, and every parameter
    is loaded in full. ValueError naming the first tensor (or the parameters) at fault, prefixed by `what`. The model
    is left exactly as it was."""
    counts: dict = {}
    dtype_errors: list = []
    current = [None]

    def tracked():
        for name, t in weights:
            current[0] = (name, tuple(t.shape), t.dtype)
            yield name, t
        current[0] = None

    saved = _meta_model(model, counts, dtype_errors)
    try:
        try:
            with torch.no_grad():
                model.load_weights(tracked())
        except Exception as e:  # noqa: BLE001 - the model's own loader refused it: named and re-raised as one line
            at = current[0]
            detail = " ".join(str(e).split())[:200] or type(e).__name__
            where = (f"tensor {at[0]!r} ({list(at[1])}, {str(at[2]).replace('torch.', '')})" if at
                     else "the weights")
            raise ValueError(f"{what}: {where} does not load into this model ({type(e).__name__}: {detail}); "
                             "send the model's own checkpoint names, shapes and dtypes") from None
        if dtype_errors:
            raise ValueError(f"{what}: {dtype_errors[0]}; send the checkpoint's floating-point tensors")
        short = sorted(name for got, need, name in counts.values() if got < need)
        if short:
            raise ValueError(f"{what}: parameters {short[:6]}{' ...' if len(short) > 6 else ''} ({len(short)}) are "
                             "not loaded in full by these weights; send every tensor of the checkpoint")
    finally:
        _put_back(saved)


def reset_layerwise(model: torch.nn.Module) -> None:
    """vLLM's layerwise reload state of every module of `model` dropped (buffered tensors, load counts, the saved
    kernel tensors), the loaders it wrapped unwrapped and the recorded metadata's layer references sanitized again."""
    layerwise, meta, _ = _layerwise()
    from vllm.model_executor.model_loader.reload.sanitize import sanitize_layer_refs

    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None:
            continue
        info.reset()
        for t in list(info.restore_metadata[0].values()) + list(info.restore_metadata[1].values()):
            if hasattr(t, "weight_loader"):
                t.weight_loader = layerwise._get_original_loader(t)
            sanitize_layer_refs(t, layer)
    layerwise.LOADING_LAYERS.clear()


class Transaction:
    """The model as it is now, to put back: a host copy of every parameter and buffer, a shallow copy of every
    module's attributes. rollback() resets vLLM's layerwise state and puts them back (exact: a reload changes the
    kernel tensors in place and replaces derived state with new objects)."""

    def __init__(self, model: torch.nn.Module):
        import time

        t0 = time.perf_counter()
        self.model = model
        self.saved = [(layer, dict(layer.__dict__), dict(layer._parameters), dict(layer._buffers),
                       set(layer._non_persistent_buffers_set)) for layer in model.modules()]
        self.values, seen = [], set()
        for _, _, params, buffers, _ in self.saved:
            for t in list(params.values()) + list(buffers.values()):
                if t is None or id(t) in seen or t.is_meta:
                    continue
                seen.add(id(t))
                self.values.append((t, t.detach().to("cpu", copy=True)))
        self.seconds = time.perf_counter() - t0

    def rollback(self) -> None:
        reset_layerwise(self.model)
        _put_back(self.saved)
        with torch.no_grad():
            for t, v in self.values:
                t.data.copy_(v)


def reload(model: torch.nn.Module, model_config, weights: list, after: Callable[[], None] | None = None) -> float:
    """vLLM's layerwise reload of `weights` ([(checkpoint name, tensor)]) into `model`, then `after()` (a check of
    the loaded model); on any exception the model is put back as it was before (Transaction) and the exception
    raised. Returns the snapshot's seconds."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    txn = Transaction(model)
    try:
        initialize_layerwise_reload(model)
        model.load_weights(weights)
        finalize_layerwise_reload(model, model_config)
        if after is not None:
            after()
    except BaseException:
        txn.rollback()
        raise
    return txn.seconds
