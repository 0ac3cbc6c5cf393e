"""Reference for samples decoded while adapter versions changed under them: HF transformers, one model per adapter
version (merged), run position by position as the engine ran them.

An engine step forwards each running request's newest position with the version served at that step, and attends
to the KV of earlier positions as they were computed then (switch: under earlier versions); a linear-attention layer
(the hybrid family) carries its conv and SSM state the same way, computed under the versions that forwarded them. So the reference feeds
the sequence in runs of positions of one version, each run through that version's model with the captured routes
forced, into one shared KV cache; position p's logits give the logprob of token p + 1.

    pos_versions = position_versions(len(prompt), versions)        # the version that forwarded each position
    lps = recompute_logprobs(models, prompt, response, routes, versions, temperature)
    worst, k3, multi = recompute_trained(out_dir, model_dir, scale)  # a keep_served run's every trained token
"""
from __future__ import annotations

import numpy as np
import torch

from moe_lora_rl.checks.forced_routes import forced, moe_gates


def position_versions(prompt_len: int, versions: list) -> list:
    """versions[k]: the version that sampled response token k, i.e. that forwarded position prompt_len - 1 + k.
    The prompt is prefilled in one step (no chunked prefill), so all its positions are versions[0]'s; the last
    response token is never forwarded."""
    if not versions:
        raise ValueError("a sample without response tokens has no versions")
    return [versions[0]] * prompt_len + list(versions[1:])


def runs(values: list) -> list[tuple[int, int, object]]:
    """[(start, end, value)] of the maximal runs of equal values."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((start, i, values[start]))
            start = i
    return out


@torch.no_grad()
def recompute_logprobs(models: dict, prompt: list[int], response: list[int], routes: np.ndarray | None,
                       versions: list, temperature: float) -> torch.Tensor:
    """models: version -> HF model (None: the base model); routes: the captured [positions, moe_layers, top_k]
    (None: each model routes itself). Returns the fp64 logprob of every response token, log_softmax(logits / T)."""
    from transformers import DynamicCache

    tokens = torch.tensor(prompt + response)
    pv = position_versions(len(prompt), versions)
    if routes is not None and routes.shape[0] < len(pv):
        raise ValueError(f"routes cover {routes.shape[0]} positions, the sample forwards {len(pv)}")
    # built from the config: the hybrid family's linear-attention layers keep conv / SSM state, not keys and values
    cache = DynamicCache(config=next(iter(models.values())).config)
    logits = []
    for a, b, v in runs(pv):
        if v not in models:
            raise ValueError(f"positions {a}..{b - 1} were served by version {v}, no reference model for it "
                             f"(have {sorted(models, key=str)})")
        model = models[v]
        kw = dict(input_ids=tokens[None, a:b], position_ids=torch.arange(a, b)[None], past_key_values=cache,
                  use_cache=True)
        if routes is None:
            logits.append(model(**kw).logits[0].double())
            continue
        gates = moe_gates(model)
        per_layer = [torch.from_numpy(np.asarray(routes[a:b, j]).astype(np.int64)) for j in range(len(gates))]
        with forced(gates, per_layer):
            logits.append(model(**kw).logits[0].double())
    lp = torch.log_softmax(torch.cat(logits) / temperature, -1)
    p = len(prompt)
    return lp[p - 1:p - 1 + len(response)].gather(-1, torch.tensor(response)[:, None])[:, 0]


def served_record(out_dir) -> tuple[dict, dict]:
    """A keep_served run's record (out_dir/served): {version: adapter tensors}, {step: the samples trained on}."""
    from pathlib import Path

    d = Path(out_dir) / "served"
    adapters = {int(p.stem[1:]): torch.load(p) for p in d.glob("v*.pt")}
    steps = {int(p.stem[4:]): torch.load(p, weights_only=False) for p in d.glob("step*.pt")}
    return adapters, steps


def recompute_trained(out_dir, model_dir: str, scale: float, versions_of=None,
                      temperature: float = 1.0) -> tuple[float, float, float]:
    """Every trained token of a keep_served run recomputed by HF (fp32, one merged model per kept version, the
    replayed routes) against the engine's logprob: (max |diff|, the largest per-sample k3 KL, the fraction of
    samples whose tokens span versions). versions_of(step, sample, models): the versions to recompute with
    (default: each token's own; a control passes others)."""
    from moe_lora_rl.checks.route_reference import merged_hf_model

    adapters, steps = served_record(out_dir)
    refs = {v: merged_hf_model(model_dir, t, scale, torch.float32) for v, t in adapters.items()}
    refs[None] = merged_hf_model(model_dir, None, scale, torch.float32)
    worst, k3, multi, n = 0.0, 0.0, 0, 0
    for step, samples in sorted(steps.items()):
        for s in samples:
            vs = s["versions"] if versions_of is None else versions_of(step, s, refs)
            lp = recompute_logprobs(refs, s["prompt"], s["response"], s["routes"], vs, temperature)
            d = lp - torch.tensor(s["logprobs"], dtype=torch.float64)
            worst = max(worst, float(d.abs().max()))
            k3 = max(k3, float((torch.exp(d) - 1 - d).mean()))
            multi += len(set(s["versions"])) > 1
            n += 1
    if not n:
        raise ValueError(f"{out_dir}/served holds no trained samples (was the run started with keep_served=true?)")
    return worst, k3, multi / n


def trained_at(step: int, sample: dict, models: dict, per_step: int = 1) -> list:
    """The negative control's versions: every token as if sampled by the version it was trained at (the newest kept
    one up to per_step * (step - 1); per_step: the optimizer steps of one RL step, mini_batches x epochs)."""
    v = max((v for v in models if v is not None and v <= per_step * (step - 1)), default=None)
    return [v] * len(sample["versions"])
