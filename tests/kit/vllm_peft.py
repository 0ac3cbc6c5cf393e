"""vLLM's own LoRA checkpoint loader on our PEFT export (CPU: parse and shapes, no LoRA kernels): the expected
modules are derived from the served model exactly as vLLM's WorkerLoRAManager._load_adapter does, the directory
is read by PEFTHelper.from_local_dir + LoRAModel.from_local_checkpoint, and every loaded LoRA module must have the
shapes of the module it adapts and the values we wrote."""
from __future__ import annotations

from pathlib import Path


def write_peft_dir(peft: dict, arch, rank: int, alpha: float, out: Path, base_model: str) -> Path:
    from safetensors.torch import save_file

    from moe_lora_rl.lora import LoRAConfig
    from moe_lora_rl.refit.export import write_config

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in peft.items()}, str(out / "adapter_model.safetensors"))
    write_config(out, LoRAConfig(rank=rank, alpha=alpha), peft, arch, base_model)
    return out


def vllm_load_check(llm, peft_dir: Path, peft: dict, arch, rank: int) -> dict:
    import torch
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import get_supported_lora_modules, process_packed_modules_mapping

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    model = runner.model
    supported = get_supported_lora_modules(model)
    packed = process_packed_modules_mapping(model)
    expected = []
    for m in supported:
        expected.extend(packed.get(m, [m]))
        if m == "experts":
            expected.append(m)
    helper = PEFTHelper.from_local_dir(str(peft_dir), runner.model_config.max_model_len)
    lora = LoRAModel.from_local_checkpoint(str(peft_dir), set(expected), helper, device="cpu",
                                           dtype=torch.float32, model_vocab_size=arch.vocab_size)
    h, i = arch.hidden_size, arch.moe_ffn_hidden_size
    want_shape = {"gate_proj": ((rank, h), (i, rank)), "up_proj": ((rank, h), (i, rank)),
                  "down_proj": ((rank, i), (h, rank))}
    bad, equal = [], True
    for name, w in lora.loras.items():
        proj = name.rsplit(".", 1)[-1]
        shapes = (tuple(w.lora_a.shape), tuple(w.lora_b.shape))
        if shapes != want_shape.get(proj):
            bad.append((name, shapes))
        key = f"base_model.model.{name}"
        equal &= torch.equal(w.lora_a, peft[key + ".lora_A.weight"]) and \
            torch.equal(w.lora_b, peft[key + ".lora_B.weight"])
    # negative control: the same loader refuses a module the model does not have
    k = next(iter(peft))
    bogus = {(n.replace(".gate_proj.", ".gate_projx.") if n.startswith(k.split(".lora_")[0]) else n): v
             for n, v in peft.items()}
    bad_dir = write_peft_dir(bogus, arch, rank, helper.lora_alpha, peft_dir.with_name(peft_dir.name + "-bogus"),
                             None)
    try:
        LoRAModel.from_local_checkpoint(str(bad_dir), set(expected), helper, device="cpu", dtype=torch.float32,
                                        model_vocab_size=arch.vocab_size)
        refused = None
    except ValueError as e:
        refused = str(e)[:200]
    return {"modules": len(lora.loras), "refused_unknown_module": refused, "expected_modules": len(peft) // 2, "rank": helper.r,
            "bad_shapes": bad[:4], "values_equal": bool(equal)}
