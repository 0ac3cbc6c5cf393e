import pytest

from moe_lora_rl.megatron.layout import Layout, parse_layouts


@pytest.mark.parametrize("name,expect,world", [
    ("tp1ep1pp1", Layout(), 1),
    ("tp2ep2", Layout(tp=2, ep=2), 2),
    ("tp2ep2etp2", Layout(tp=2, ep=2, etp=2), 4),
    ("ep4", Layout(ep=4), 4),
    ("pp2ep2", Layout(ep=2, pp=2), 4),
    ("ep2pp2", Layout(ep=2, pp=2), 4),
    ("etp2tp2", Layout(tp=2, etp=2), 2),
    ("tp4ep2", Layout(tp=4, ep=2), 4),
    ("tp2pp2ep4", Layout(tp=2, ep=4, pp=2), 8),
])
def test_parse_and_min_world(name, expect, world):
    lay = Layout.parse(name)
    assert lay == expect
    assert lay.min_world_size == world
    lay.check_world_size(world)
    lay.check_world_size(2 * world)


@pytest.mark.parametrize("bad", ["", "tp", "tp0", "tp2x", "tp2tp2", "dp2", "tp-1"])
def test_parse_rejects(bad):
    with pytest.raises(ValueError, match="layout"):
        Layout.parse(bad)


def test_world_size_mismatch_names_values():
    with pytest.raises(ValueError, match=r"world size 2 .*etp\*ep\*pp=4.*smallest that works is 4"):
        Layout.parse("tp2ep2etp2").check_world_size(2)
    with pytest.raises(ValueError, match="world size 3"):
        Layout.parse("tp2").check_world_size(3)


def test_model_divisibility():
    kw = dict(num_layers=4, num_heads=4, num_kv_heads=2, num_experts=16, moe_ffn=32, ffn=256)
    Layout.parse("tp2ep4pp2").check_model(**kw)
    with pytest.raises(ValueError, match=r"ep=3 does not divide num_experts=16; ep must be one of \[1, 2, 4, 8, 16\]"):
        Layout.parse("ep3").check_model(**kw)
    with pytest.raises(ValueError, match="pp=3 does not divide num_layers=4"):
        Layout.parse("pp3").check_model(**kw)
    with pytest.raises(ValueError, match="tp=4 does not divide num_key_value_heads=2"):
        Layout.parse("tp4").check_model(**kw)
    with pytest.raises(ValueError, match="etp=3 does not divide moe_intermediate_size=32"):
        Layout.parse("etp3").check_model(**kw)


def test_parse_layouts_list():
    assert [l.name for l in parse_layouts("tp2ep2, pp2ep2 ,ep4")] == ["tp2ep2", "ep2pp2", "ep4"]
