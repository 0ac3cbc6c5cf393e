"""Check a recipe's training layout against the model's real config before anything starts:
    python recipes/verl_moe_lora/check_layouts.py MODEL LAYOUT GPUS
MODEL: a preset of moe_lora_rl.plan (qwen3-30b-a3b, kimi-k2, deepseek-v3, moonlight) or a config.json; LAYOUT like
tp4ep8; GPUS: training GPUs (a multiple of the layout's smallest world size). For a DeepseekV3 (MLA) config every
tensor name of the released checkpoint (per-expert names, fp8 weight_scale_inv, MTP layers), derived from the config
without weights, is mapped onto the layout's Megatron parameters (moe_lora_rl.models.released). Exit 2 with a one-line
error otherwise."""
import json
import sys
from pathlib import Path

from moe_lora_rl.megatron.layout import Layout
from moe_lora_rl.models.released import map_released
from moe_lora_rl.plan import specs

CONFIGS = {"qwen3-30b-a3b": specs.QWEN3_30B_A3B_CONFIG, "kimi-k2": specs.KIMI_K2_CONFIG,
           "deepseek-v3": specs.DEEPSEEK_V3_CONFIG, "moonlight": specs.MOONLIGHT_CONFIG}


def check(model: str, layout: str, gpus: int) -> tuple[Layout, str]:
    cfg = CONFIGS.get(model) or json.loads(Path(model).read_text())
    lay = Layout.parse(layout)
    first_dense = cfg.get("first_k_dense_replace", 0)
    lay.check_model(num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                    num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                    num_experts=cfg.get("n_routed_experts") or cfg["num_experts"],
                    moe_ffn=cfg["moe_intermediate_size"], ffn=cfg["intermediate_size"] if first_dense else None)
    lay.check_world_size(gpus)
    if not cfg.get("kv_lora_rank"):
        return lay, ""
    if cfg.get("q_lora_rank") and cfg["q_lora_rank"] % lay.tp:
        raise ValueError(f"tp={lay.tp} does not divide the MLA down projection's rows q_lora_rank={cfg['q_lora_rank']}")
    m = map_released(cfg, tp=lay.tp, pp=lay.pp, ep=lay.ep)
    return lay, (f"; {m.mapped} released tensors mapped, {m.scales} fp8 scales paired, {m.mtp_skipped} MTP "
                 "tensors skipped")


def main(argv=None) -> int:
    a = sys.argv[1:] if argv is None else argv
    try:
        if len(a) != 3:
            raise ValueError("usage: check_layouts.py MODEL LAYOUT GPUS")
        lay, names = check(a[0], a[1], int(a[2]))
    except (ValueError, KeyError, OSError) as e:
        print(f"check_layouts: error: {e}", file=sys.stderr)
        return 2
    print(f"{a[0]}: {lay} on {a[2]} GPUs ok{names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
