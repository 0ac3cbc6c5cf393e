"""The version table of an engine (vllm/versions.py) without an engine: switch holds the newest version only; pin
holds the newest version and every older one a tracked request runs on, frees an older version with its last
request, refuses a commit that does not fit (naming the version, max_versions and the held versions with their
request counts) and never evicts a version in use; the config check names the bad value."""
import pytest

from moe_lora_rl.vllm.versions import (InflightConfig, VersionTable, cache_salt, check_inflight_config,
                                       external_id)


def _pin(max_versions=2, on_full="wait"):
    return VersionTable(InflightConfig("pin", max_versions, on_full))


def test_config_defaults_and_bad_values_named():
    assert check_inflight_config("unmerged") == InflightConfig("switch", 1, "wait")
    assert check_inflight_config("unmerged", "pin", None, "refuse") == InflightConfig("pin", 2, "refuse")
    assert check_inflight_config("merged", "switch", 1) == InflightConfig("switch", 1, "wait")
    for args, msg in ((("unmerged", "hold"), r"moe_lora_inflight='hold'"),
                      (("unmerged", "pin", 0), r"moe_lora_max_versions=0: expected an integer >= 1"),
                      (("unmerged", "pin", 2.0), r"moe_lora_max_versions=2\.0"),
                      (("unmerged", "pin", True), r"moe_lora_max_versions=True"),
                      (("unmerged", "switch", 3), r"moe_lora_max_versions=3: inflight='switch' holds exactly one"),
                      (("unmerged", "pin", 2, "drop"), r"moe_lora_on_full='drop'"),
                      (("merged", "pin"), r"moe_lora_inflight='pin' needs moe_lora_serving='unmerged'"),
                      (("fused",), r"moe_lora_serving='fused'")):
        with pytest.raises(ValueError, match=msg) as e:
            check_inflight_config(*args)
        assert "\n" not in str(e.value)


def test_salt_and_ids():
    assert (cache_salt(7), cache_salt(None)) == ("moe-lora-v7", "moe-lora-base")
    assert cache_salt(7) != cache_salt(8)
    assert external_id("r3-1a2b3c4d") == "r3" and external_id("a-b-1a2b3c4d") == "a-b"
    assert external_id("r3") == "r3" and external_id("r3-abc") == "r3-abc"      # no engine suffix


def test_switch_holds_the_newest_only():
    t = VersionTable()
    assert t.track([["a", None]]) == [None]                                   # nothing served: the base model
    assert t.admit(1) == [] and t.admit(2) == [1] and t.held == [2]          # a commit replaces the version
    assert t.serving("a") == 2 and t.serving("untracked") == 2               # switch: every request on the newest
    assert t.track([["b", 2], ["c", None]]) == [2, 2]
    with pytest.raises(ValueError, match=r"request d asks for version 1: inflight='switch' serves only .* \(2\)"):
        t.track([["d", 1]])
    assert t.can_commit() and t.status()["requests_per_version"] == {"2": 3}
    assert t.release(["a", "b", "c", "zz"]) == [] and t.held == [2]
    with pytest.raises(ValueError, match="stale adapter version 2: version 2 is served"):
        t.admit(2)
    with pytest.raises(ValueError, match="adapter version must be a non-negative integer, got '3'"):
        t.admit("3")
    assert t.clear() == [2] and t.newest is None


def test_pin_tracks_frees_and_refuses_when_full():
    t = _pin(max_versions=2)
    t.admit(5)
    assert t.track([["r1", None], ["r2", 5]]) == [5, 5]
    assert t.admit(6) == [] and t.held == [5, 6]                              # 5 still runs r1, r2
    assert t.track([["r3", None]]) == [6]
    assert (t.serving("r1"), t.serving("r3"), t.serving("untracked")) == (5, 6, 6)
    assert not t.can_commit()
    with pytest.raises(ValueError) as e:
        t.admit(7)
    msg = str(e.value)
    assert ("cannot commit adapter version 7: max_versions=2" in msg
            and "5 (2 requests), 6 (newest, 1 request)" in msg and "\n" not in msg), msg
    assert t.held == [5, 6] and t.requests == {"r1": 5, "r2": 5, "r3": 6}    # the refused commit changed nothing
    assert t.release(["r1"]) == [] and t.held == [5, 6]                      # r2 still on 5
    assert t.release(["r2", "r2", "unknown"]) == [5] and t.held == [6]       # last request of 5: freed, idempotent
    assert t.can_commit()
    assert t.admit(7) == [] and t.held == [6, 7]                             # 6 runs r3: kept
    assert t.status() == {"inflight": "pin", "max_versions": 2, "on_full": "wait", "versions": [6, 7],
                          "requests_per_version": {"6": 1}, "can_commit": True}    # 7 unused: superseded
    t.release(["r3"])
    assert t.held == [7] and t.can_commit()


def test_a_commit_supersedes_an_unused_newest():
    """The newest serves every new request, so a release keeps it; a commit replaces it, so a newest no request runs
    on is freed by the commit and leaves its slot to the new version."""
    t = _pin(max_versions=2)
    t.admit(1)
    t.track([["a", None]])
    t.admit(2)                                                                # no request on 2 (yet)
    assert t.release([]) == [] and t.held == [1, 2]                           # the newest stays for new requests
    assert t.can_commit() and t.plan_admit(3) == [2] and t.held == [1, 2]     # planning changes nothing
    assert t.admit(3) == [2] and t.held == [1, 3]                             # 1 still runs a
    t.track([["b", None]])
    assert not t.can_commit()
    with pytest.raises(ValueError, match=r"version 4: max_versions=2 .* 1 \(1 request\), 3 \(newest, 1 request\)"):
        t.admit(4)
    assert t.release(["a"]) == [1] and t.held == [3]


def test_pin_with_one_version_drains_before_a_commit():
    t = _pin(max_versions=1)
    t.admit(1)
    t.track([["a", None]])
    assert not t.can_commit()
    with pytest.raises(ValueError, match=r"version 2: max_versions=1 .* 1 \(newest, 1 request\)"):
        t.admit(2)
    t.release(["a"])
    assert t.admit(2) == [1] and t.held == [2]


def test_pin_never_evicts_a_referenced_version():
    t = _pin(max_versions=3)
    for v in (1, 2, 3):
        t.admit(v)
        t.track([[f"q{v}", None]])
    t.release(["q2"])                                                        # 2 is freed right away
    assert t.held == [1, 3]
    t.track([["q4", 1]])                                                     # an explicit pin to a held version
    assert t.admit(4) == [] and t.held == [1, 3, 4]
    t.track([["q5", None]])                                                  # on 4
    with pytest.raises(ValueError, match=r"version 5: max_versions=3 .* 1 \(2 requests\), 3 \(1 request\), 4 "):
        t.admit(5)                                                           # full: nothing in use is evicted
    assert t.held == [1, 3, 4]
    t.release(["q3"])
    assert t.held == [1, 4] and t.admit(5) == [] and t.held == [1, 4, 5]
    t.release(["q1", "q4", "q5"])
    assert t.held == [5]


def test_pin_explicit_version_all_or_nothing():
    t = _pin(max_versions=2)
    t.admit(6)
    t.track([["r0", None]])
    t.admit(7)
    with pytest.raises(ValueError, match=r"request r3 pinned to version 5: the engine holds versions \[6, 7\]"):
        t.track([["r1", None], ["r2", 6], ["r3", 5]])
    assert t.requests == {"r0": 6}                                           # nothing tracked
    with pytest.raises(ValueError, match="request r1 is already tracked"):
        t.track([["r1", 7], ["r1", 7]])
    with pytest.raises(ValueError, match=r"request r1: version '7' is not an integer"):
        t.track([["r1", "7"]])
    assert t.track([["r1", 6], ["r2", None]]) == [6, 7]


def test_base_requests_take_no_slot_and_clear():
    t = _pin(max_versions=2)
    assert t.track([["b", None]]) == [None]                                  # base model: no slot
    assert t.can_commit() and t.admit(1) == []
    assert t.serving("b") is None and t.status()["requests_per_version"] == {"None": 1}
    t.track([["r", None]])
    with pytest.raises(ValueError, match=r"cannot clear the adapters: versions \[1\] are in use"):
        t.clear()
    t.release(["r"])
    assert t.clear() == [1] and t.serving("b") is None                        # the base request is no obstacle


def test_policies_share_the_slots_and_each_keeps_its_newest():
    """Two policies on one pin engine: a commit supersedes its own policy's newest version only; the other policy's
    newest stays held and servable; an older version in use stays until its last request ends."""
    t = _pin(max_versions=3)
    assert t.admit(1, "a") == [] and t.admit(2, "b") == []           # b's commit keeps a's newest
    assert (t.newest_of("a"), t.newest_of("b")) == (1, 2)
    assert t.track([["ra", 1], ["rb", 2]]) == [1, 2]
    assert t.admit(3, "a") == [] and t.held == [1, 2, 3]              # 1 still runs ra
    assert t.release(["ra"]) == [1]                                   # a's older version freed with its request
    assert t.admit(4, "a") == [3] and t.held == [2, 4]                # superseded: a's 3, not b's 2
    assert t.status()["owners"] == {"2": "b", "4": "a"}
    # control: the same commits without owners free the other policy's newest
    u = _pin(max_versions=3)
    u.admit(1)
    assert u.admit(2) == [1]


def test_policies_full_engine_refused_and_policy_needs_pin():
    t = _pin(max_versions=2)
    t.admit(1, "a"), t.admit(2, "b")
    t.track([["ra", 1], ["rb", 2]])
    assert not t.can_commit("a")
    with pytest.raises(ValueError, match="cannot commit adapter version 3: max_versions=2"):
        t.admit(3, "a")                                               # a's 1 and b's 2 both in use
    t.release(["ra"])
    assert t.can_commit("a") and t.admit(3, "a") == [1]
    assert not t.can_commit("c")                                      # a third policy finds no free slot
    with pytest.raises(ValueError, match="several policies on one engine need inflight='pin'"):
        VersionTable().admit(1, "a")


@pytest.mark.parametrize("pin", [False, True])
def test_a_version_number_is_never_admitted_twice_in_an_engine_life(pin):
    """3, then 4, then a clear, then 2 or 3 again: refused in one line naming the number and the highest passed,
    nothing changed; 5 is admitted. Every cache keyed by a version (the prefix cache's cache_salt, the route store,
    the merged-weight record, the adapter slots) then holds one set of weights per key. The same at the push's
    begin on the FakeEngine (the worker extension's protocol), before any bucket is sent."""
    import torch

    from kit.fakes import FakeEngine

    tensors = {"a": torch.zeros(4), "b": torch.ones(4)}
    t = _pin() if pin else VersionTable()
    t.admit(3)
    t.admit(4)
    assert t.clear() == [4] and t.newest is None
    for v in (2, 3, 4):
        with pytest.raises(ValueError, match=rf"adapter version {v} was already passed by this engine \(it admitted "
                                             r"up to version 4") as e:
            t.admit(v)
        assert "\n" not in str(e.value) and t.held == [] and t.newest is None
    assert t.admit(5) == [] and t.held == [5]
    eng = FakeEngine()
    eng.push(3, tensors, 4, 8.0)
    eng.call("moe_lora_clear")
    with pytest.raises(ValueError, match=r"adapter version 3 was already passed"):
        eng.push(3, tensors, 4, 8.0)
    assert eng.st.version is None and eng.push(4, tensors, 4, 8.0).served["version"] == 4
