"""A hybrid linear-attention checkpoint's engine setting (vllm/hybrid_config.py, pure): on an engine without chunked
prefill, prefix caching off with one line, whether asked for or left to vLLM; with chunked prefill, and for other
checkpoints, unchanged. Both layouts of Qwen3.5 (text config, and the
released one with text_config) and Qwen3-Next are hybrid; the GQA tiny is not."""
import json

import pytest

from moe_lora_rl.vllm.hybrid_config import is_hybrid, prefix_caching


def _ckpt(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("config", [
    {"layer_types": ["linear_attention", "full_attention"]},
    {"text_config": {"layer_types": ["linear_attention", "linear_attention", "full_attention"]}},
])
def test_hybrid_prefix_caching_off_with_one_line(tmp_path, config):
    d = _ckpt(tmp_path, config)
    assert is_hybrid(config)
    for asked in (None, True):
        value, lines = prefix_caching(d, asked, chunked_prefill=False)
        assert value is False and len(lines) == 1 and "chunked prefill" in lines[0], (asked, lines)
        for chunked in (None, True):
            assert prefix_caching(d, asked, chunked_prefill=chunked) == (asked, [])
    assert prefix_caching(d, False, chunked_prefill=False) == (False, [])


def test_other_checkpoints_unchanged(tmp_path):
    d = _ckpt(tmp_path, {"layer_types": ["full_attention", "sliding_attention"]})
    for asked in (None, True, False):
        assert prefix_caching(d, asked, chunked_prefill=False) == (asked, [])
    assert prefix_caching(tmp_path / "missing", True, chunked_prefill=False) == (True, [])


def test_tiny_checkpoints():
    from moe_lora_rl.models import get_model

    for family, size, want in (("qwen3_5_moe", "tiny", True), ("qwen3_5_moe", "tiny_vl", True),
                               ("qwen3_next", "tiny", True), ("glm4_moe", "tiny", False)):
        config = json.loads((get_model(family, size) / "config.json").read_text())
        assert is_hybrid(config) == want, (family, size)
