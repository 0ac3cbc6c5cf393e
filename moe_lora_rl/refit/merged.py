"""An adapter folded into the base weights: W + scale * B @ A (fp64 merge).

    merged_state(model_dir, peft, scale)        every checkpoint tensor, merged where adapted (in memory, fp32): the
                                                full-weight refit, and engines that cannot serve LoRA
    save_merged(model_dir, adapter_dir, out)    a PEFT adapter directory merged into a copy of the HF checkpoint, file
                                                by file (one safetensors shard in memory at a time, each tensor in its
                                                own dtype): a checkpoint any server loads with no LoRA support
    MergedInprocTransport(llm, model_dir)       the full-weight refit into a vLLM in this process: push() merges the
                                                adapter and reloads every weight (reload_weights)

    python -m moe_lora_rl.refit.merged --model MODEL_DIR --adapter ADAPTER_DIR --out OUT_DIR

Why a merged checkpoint: vLLM's own LoRA ignores an MLA model's kv_b_proj adapter (its absorbed decode never calls
the layer; docs/mla.md), so an adapter with kv_up factors is served exactly only by our worker extension or merged.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from ..transfer.interface import PushResult, RefitError

MERGEABLE = (torch.float32, torch.bfloat16, torch.float16)


def peft_deltas(model_dir: str | Path, peft: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """HF weight name -> scale * B @ A (fp64) for every adapted module of a PEFT adapter's tensors."""
    from ..models.arch import arch_from_hf_config
    from ..models.naming import naming_for

    naming = naming_for(arch_from_hf_config(json.loads((Path(model_dir) / "config.json").read_text())))
    delta = {}
    for k, A in peft.items():
        name, part, ab = naming.parse_peft(k)
        if ab == "A":
            B = peft[k.replace(".lora_A.", ".lora_B.")]
            delta[naming.hf_modules(name)[part] + ".weight"] = (B.double() @ A.double()) * scale
    return delta


def merged_state(model_dir: str | Path, peft: dict[str, torch.Tensor], scale: float) -> list[tuple[str, torch.Tensor]]:
    from ..models.checkpoint import HFCheckpoint

    ck = HFCheckpoint(model_dir)
    delta = peft_deltas(model_dir, peft, scale)
    out = []
    for name in ck.weight_map:
        t = ck.get(name).float()
        if name in delta:
            t = (t.double() + delta.pop(name)).float()
        out.append((name, t))
    if delta:
        raise ValueError(f"merged refit: adapters for tensors not in the checkpoint: {sorted(delta)[:4]}")
    return out


def adapter_scale(adapter_config: dict) -> float:
    """lora_alpha / r of a PEFT adapter_config.json (ValueError for what this merge does not reproduce)."""
    for key in ("use_rslora", "use_dora"):
        if adapter_config.get(key):
            raise ValueError(f"adapter_config.json {key}=True: the merge computes W + lora_alpha / r * B @ A only")
    if adapter_config.get("rank_pattern") or adapter_config.get("alpha_pattern"):
        raise ValueError("adapter_config.json has a rank_pattern / alpha_pattern: one scale per adapter is merged")
    return float(adapter_config["lora_alpha"]) / float(adapter_config["r"])


def save_merged(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """A PEFT adapter directory (adapter_model.safetensors + adapter_config.json, as refit/export.py writes it) merged
    into a copy of the HF checkpoint MODEL_DIR at OUT_DIR: the same safetensors files and index, each adapted tensor
    W + scale * B @ A in fp64 and rounded once to W's dtype; the other files copied. ValueError (nothing written)
    for an adapted tensor the checkpoint lacks or stores quantized (fp8 with weight_scale_inv), or OUT_DIR equal to
    MODEL_DIR."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ..models.checkpoint import HFCheckpoint

    model, adapter, out = Path(model_dir), Path(adapter_dir), Path(out_dir)
    if out.resolve() == model.resolve():
        raise ValueError(f"--out {out} is the base checkpoint itself: choose another directory")
    scale = adapter_scale(json.loads((adapter / "adapter_config.json").read_text()))
    delta = peft_deltas(model, load_file(str(adapter / "adapter_model.safetensors")), scale)
    ck = HFCheckpoint(model)
    missing = sorted(set(delta) - set(ck.weight_map))
    if missing:
        raise ValueError(f"the adapter adapts tensors the checkpoint {model} lacks: {missing[:4]}")
    files: dict[str, list[str]] = {}
    for stored, f in ck.stored_map.items():                  # every tensor, a vision tower's and MTP's included
        files.setdefault(f, []).append(stored)
    stored_delta = {ck.stored_name(name): d for name, d in delta.items()}
    for name in delta:
        with safe_open(str(model / ck.weight_map[name]), "pt") as s:
            dtype = s.get_slice(ck.stored_name(name)).get_dtype()
        if name.removesuffix(".weight") + ".weight_scale_inv" in ck.weight_map or dtype not in ("F32", "BF16", "F16"):
            raise ValueError(f"{name} is stored as {dtype} (quantized): merge into a dequantized checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    for fname, names in files.items():
        tensors = {}
        for name in names:
            t = ck.get_stored(name)
            if name in stored_delta:
                t = (t.double() + stored_delta[name]).to(t.dtype)
                if not torch.isfinite(t).all():
                    raise ValueError(f"{name}: the merged weight overflows {t.dtype}")
            tensors[name] = t.contiguous()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
    return out


class MergedInprocTransport:
    """The push(version, tensors, rank, alpha) and status() of a transport (transfer/interface.py); moves the whole
    model with the adapters merged."""

    def __init__(self, llm, model_dir: str):
        self.llm, self.model_dir, self.version = llm, model_dir, None

    def push(self, version: int, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> PushResult:
        if self.version is not None and version <= self.version:
            raise ValueError(f"stale weight version {version}: version {self.version} is served")
        t0 = time.perf_counter()
        weights = merged_state(self.model_dir, tensors, alpha / rank)
        try:
            self.llm.collective_rpc("moe_lora_clear")            # the merged weights already hold the adapter
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.reset_prefix_cache()
        except Exception as e:  # noqa: BLE001
            raise RefitError(f"full-weight reload failed: {e}") from e
        self.version = version
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        return PushResult(version, nbytes, time.perf_counter() - t0, {"version": version})

    def status(self) -> dict:
        return {"version": self.version}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.refit.merged",
                                 description="merge a PEFT adapter into a copy of its HF checkpoint")
    ap.add_argument("--model", required=True, help="the base HF checkpoint directory")
    ap.add_argument("--adapter", required=True, help="the PEFT adapter directory (e.g. a run's adapter/)")
    ap.add_argument("--out", required=True, help="where the merged checkpoint is written")
    a = ap.parse_args(argv)
    try:
        out = save_merged(a.model, a.adapter, a.out)
    except (ValueError, OSError, KeyError) as e:
        print(f"merge: {e}", file=sys.stderr)
        return 2
    print(f"merged checkpoint: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
