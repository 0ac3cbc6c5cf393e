"""The engine loop's scheduling rules (rollout/loop.py) on a scripted engine, no model: every response token is
stamped with the version served at the step that made it (switch) or its request's pinned version (pin); a commit
waits until every admitted request has prefilled (switch) and while the worker reports no room (pin, wait); a
request whose routes cannot be popped fails alone; a refused submission fails all its requests; several client
threads share the engine. The same rules against vLLM: tests/e2e/test_inflight.py."""
import threading
import time

import numpy as np
import pytest

pytest.importorskip("vllm")

from moe_lora_rl.rollout.loop import EngineLoop  # noqa: E402
from moe_lora_rl.rollout.tickets import Request  # noqa: E402


class Params:
    def __init__(self, max_tokens, logprobs=0, prompt_logprobs=None):
        self.max_tokens, self.logprobs, self.prompt_logprobs, self.output_kind = max_tokens, logprobs, \
            prompt_logprobs, None

    def clone(self):
        p = Params(self.max_tokens, self.logprobs, self.prompt_logprobs)
        return p


class Lp:
    def __init__(self, v):
        self.logprob = v


class Out:
    def __init__(self, rid, toks, finished):
        self.request_id, self.finished, self.prompt_logprobs = rid, finished, None
        self.outputs = [type("C", (), {"token_ids": toks, "logprobs": [{t: Lp(-0.5)} for t in toks],
                                       "finish_reason": "length" if finished else None})()]


class Engine:
    """Prefills at most `budget` new requests per step (the rest wait), then one token per request per step."""

    def __init__(self, budget=100, step_s=0.002):
        self.reqs, self.budget, self.steps, self.log, self.step_s = {}, budget, 0, [], step_s
        self.vllm_config = type("V", (), {"cache_config": type("C", (), {"enable_prefix_caching": True})()})()

    def add_request(self, rid, prompt, params):
        self.reqs[rid] = {"n": 0, "max": params.max_tokens, "started": False, "prompt": prompt["prompt_token_ids"]}

    def abort_request(self, rids, internal=False):
        for r in rids:
            self.reqs.pop(r, None)

    def reset_prefix_cache(self):
        return True

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        self.steps += 1
        outs, new = [], 0
        for rid, r in list(self.reqs.items()):
            if not r["started"]:
                if new == self.budget:
                    continue
                new += 1
                r["started"] = True
            r["n"] += 1
            done = r["n"] == r["max"]
            outs.append(Out(rid, [r["n"]], done))
            if done:
                del self.reqs[rid]
        time.sleep(self.step_s)
        return outs


class LLM:
    def __init__(self, engine, pin=False):
        self.llm_engine, self.version, self.pin = engine, None, pin
        self.tracked, self.can_commit, self.fail_routes = {}, True, set()

    def collective_rpc(self, method, args=(), kwargs=None):
        return [getattr(self, method)(*args)]

    def moe_lora_status(self):
        return {"version": self.version, "can_commit": self.can_commit}

    def moe_lora_track(self, reqs):
        out = []
        for rid, v in reqs:
            if v is not None and v != self.version:
                raise ValueError(f"request {rid} pinned to version {v}: the engine holds versions [{self.version}]")
            out.append(self.version)
        self.tracked.update({rid: v for (rid, _), v in zip(reqs, out)})
        return out

    def moe_lora_release(self, rids):
        for r in rids:
            self.tracked.pop(r, None)
        return {"freed": []}

    def moe_lora_push(self, version):
        if not self.can_commit:
            raise ValueError(f"cannot commit adapter version {version}: max_versions=1 and the held versions ...")
        self.version = version
        self.llm_engine.log.append(("commit", version, self.llm_engine.steps))
        return {"version": version}

    def moe_lora_capture_pop(self, rids):
        bad = [r for r in rids if r in self.fail_routes]
        if bad:
            raise ValueError(f"incomplete routes for request {bad[0]!r}")
        return {r: np.zeros((len(self.llm_engine_prompt(r)) + 0, 1, 1), np.uint8) for r in rids}

    def llm_engine_prompt(self, rid):
        return []


def make(pin=False, budget=100, meta=None, step_s=0.002, on_full="wait"):
    eng = Engine(budget, step_s)
    llm = LLM(eng, pin)
    return eng, llm, EngineLoop(llm, meta, inflight="pin" if pin else "switch", on_full=on_full).start()


def test_switch_stamps_each_token_with_the_version_of_its_step():
    eng, llm, loop = make()
    try:
        t = loop.submit([Request([1, 2], Params(60)) for _ in range(3)])
        while eng.steps < 10:
            time.sleep(0.001)
        loop.rpc("moe_lora_push", (1,))
        while eng.steps < 30:
            time.sleep(0.001)
        loop.rpc("moe_lora_push", (2,))
        out = t.results()
    finally:
        loop.stop()
    commits = {v: s for _, v, s in eng.log}
    for g in out:
        assert len(g.versions) == 60 and g.response == list(range(1, 61))
        # token k was made at engine step k + first step; a commit after step s stamps the tokens of steps > s
        assert g.versions == [None] * commits[1] + [1] * (commits[2] - commits[1]) + [2] * (60 - commits[2])
    assert 10 <= commits[1] < commits[2] < 60


def test_switch_commit_waits_until_admitted_requests_prefilled():
    eng, llm, loop = make(budget=1, step_s=0.05)     # one prefill per step: the 3rd request waits two steps
    try:
        t = loop.submit([Request([1], Params(6)) for _ in range(3)])
        while len(eng.reqs) < 3:
            time.sleep(0.001)
        admitted = eng.steps
        loop.rpc("moe_lora_push", (1,))                 # queued while the first prefill runs
        out = t.results()
    finally:
        loop.stop()
    (_, _, at), = eng.log
    # without the barrier the commit lands after one step and the 2nd and 3rd requests prefill under version 1
    # although they were admitted (and salted) under None
    assert [g.versions[0] for g in out] == [None, None, None]
    assert at >= 3 and admitted <= 1


def test_pin_full_commit_waits_for_room_then_lands():
    eng, llm, loop = make(pin=True)
    try:
        llm.can_commit = False
        t = loop.submit([Request([1], Params(30))])
        done = {}
        th = threading.Thread(target=lambda: done.update(r=loop.rpc("moe_lora_push", (3,)), at=eng.steps))
        th.start()
        time.sleep(0.1)
        assert th.is_alive() and llm.version is None          # waiting, requests still decode
        steps_while_waiting = eng.steps
        llm.can_commit = True
        th.join(10)
        assert done["r"] == {"version": 3} and done["at"] >= steps_while_waiting
        [g] = t.results()
        assert g.versions == [None] * 30                      # pin: the request keeps its version
        assert loop.stats["commit_wait_s"] > 0.05
    finally:
        loop.stop()


def test_pin_full_commit_is_refused_at_once_with_on_full_refuse():
    eng, llm, loop = make(pin=True, on_full="refuse")
    try:
        llm.can_commit = False
        t = loop.submit([Request([1], Params(30))])
        with pytest.raises(ValueError, match="cannot commit adapter version 3: max_versions=1"):
            loop.rpc("moe_lora_push", (3,))
        assert llm.version is None and eng.reqs                   # refused while the request still decodes
        assert [g.versions for g in t.results()] == [[None] * 30]
    finally:
        loop.stop()


def test_a_request_with_bad_routes_fails_alone_and_refused_submissions_fail_whole():
    eng, llm, loop = make(meta={"layer_ids": [0], "topk": 1, "num_experts": 2})
    llm.llm_engine_prompt = lambda rid: [0] * (1 + 4 - 1)         # prompt 1 + response 4 - 1 rows
    try:
        llm.fail_routes = {"r1"}
        out = loop.submit([Request([1], Params(4)) for _ in range(3)]).results()
        assert isinstance(out[1], RuntimeError) and "routing capture" in str(out[1])
        assert [len(g.response) for i, g in enumerate(out) if i != 1] == [4, 4]
        bad = loop.submit([Request([1], Params(4)), Request([1], Params(4), version=7)]).results()
        assert all(isinstance(e, ValueError) and "pinned to version 7" in str(e) for e in bad)
        assert llm.tracked == {} and not eng.reqs                # nothing left behind
        with pytest.raises(ValueError, match="pinned to version 7"):
            loop.generate([Request([1], Params(4), version=7)])
    finally:
        loop.stop()


def test_concurrent_clients_share_the_engine_steps():
    eng, llm, loop = make()
    try:
        res = {}
        ths = [threading.Thread(target=lambda i=i: res.update({i: loop.generate(
            [Request([i], Params(20 + i)) for _ in range(2)])})) for i in range(4)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(30)
        assert sorted(res) == [0, 1, 2, 3]
        assert all(len(g.response) == 20 + i for i, gs in res.items() for g in gs)
        assert eng.steps < 4 * 20                            # batched together, not one client after another
    finally:
        loop.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        loop.submit([Request([1], Params(1))])


class CachingEngine(Engine):
    """A prefix cache keyed like vLLM's (cache_salt, prompt): a hit serves the KV computed under the base that
    filled it."""

    def __init__(self):
        super().__init__()
        self.base, self.cache, self.prompt_base, self.resets = "A", {}, {}, 0

    def add_request(self, rid, prompt, params):
        super().add_request(rid, prompt, params)
        key = (prompt.get("cache_salt"), tuple(prompt["prompt_token_ids"]))
        self.prompt_base[rid] = self.cache.setdefault(key, self.base)

    def reset_prefix_cache(self):
        self.cache.clear()
        self.resets += 1
        return True


class BaseSyncLLM(LLM):
    """vLLM's weight-transfer calls: finish loads the staged base."""

    def start_weight_update(self):
        self.staged = "B"

    def update_weights(self, info):
        pass

    def finish_weight_update(self):
        self.llm_engine.base = self.staged


def test_a_base_update_resets_the_prefix_cache_and_is_refused_while_requests_run():
    """A prompt served under base A, base B synced, the same prompt again: its prompt is computed under B (the
    base salt is the same across bases, so without the reset the cache serves A's blocks: the control, run on the
    loop without its reset, asserts exactly that). A base update while a request runs is refused in one line and
    changes nothing; a request submitted while an update is open is admitted after it finishes."""
    eng = CachingEngine()
    llm = BaseSyncLLM(eng)
    loop = EngineLoop(llm, None, inflight="switch").start()
    try:
        first = loop.submit([Request([1, 2, 3], Params(2))])
        first.results()
        t = loop.submit([Request([9], Params(400))])
        while not eng.reqs:
            time.sleep(0.001)
        for method, args in (("start_weight_update", ()), ("update_weights", ({},)), ("finish_weight_update", ())):
            with pytest.raises(ValueError, match=f"{method}: a base update while 1 requests run is refused"):
                loop.rpc(method, args)
        assert eng.base == "A" and eng.resets == 0
        t.results()
        loop.rpc("start_weight_update")
        again = loop.submit([Request([1, 2, 3], Params(2))])      # submitted while the update is open: it waits
        time.sleep(0.1)
        assert not eng.reqs and again.request_ids == []
        loop.rpc("update_weights", ({},))
        loop.rpc("finish_weight_update")
        assert eng.base == "B" and eng.resets == 1
        again.results()
        assert eng.prompt_base[first.request_ids[0]] == "A" and eng.prompt_base[again.request_ids[0]] == "B"
        # control: the same sync through llm directly (no loop, no reset) leaves A's blocks served under B
        eng.base = "A"
        eng.reset_prefix_cache()
        eng.add_request("c1", {"prompt_token_ids": [4, 5], "cache_salt": "moe-lora-base"}, Params(1))
        llm.start_weight_update(), llm.finish_weight_update()
        eng.add_request("c2", {"prompt_token_ids": [4, 5], "cache_salt": "moe-lora-base"}, Params(1))
        assert eng.base == "B" and eng.prompt_base["c2"] == "A"
        eng.reqs.clear()
    finally:
        loop.stop()


class AbortableBaseSyncLLM(BaseSyncLLM):
    def moe_lora_base_abort(self):
        self.staged, self.aborts = None, getattr(self, "aborts", 0) + 1
        return {"served": self.llm_engine.base}


def test_a_base_update_whose_sender_died_is_aborted_after_base_timeout_s():
    """start_weight_update, one bucket, then nothing (the sender died): requests submitted meanwhile are held until
    base_timeout_s passes without a base call, then the loop aborts the update (moe_lora_base_abort) and admits them
    on the old base. Control: with a long timeout the same request is still held."""
    for timeout, held in ((0.3, False), (60.0, True)):
        eng = CachingEngine()
        llm = AbortableBaseSyncLLM(eng)
        loop = EngineLoop(llm, None, inflight="switch", base_timeout_s=timeout).start()
        try:
            loop.rpc("start_weight_update")
            loop.rpc("update_weights", ({},))
            t0 = time.perf_counter()
            ticket = loop.submit([Request([1, 2, 3], Params(2))])
            time.sleep(1.0)
            assert (ticket.request_ids == []) is held
            if not held:
                ticket.results()
                assert time.perf_counter() - t0 < 1.5 and eng.prompt_base[ticket.request_ids[0]] == "A"
                assert llm.aborts == 1 and loop.stats["base_expired"] == 1 and eng.base == "A"
        finally:
            loop.stop()
    with pytest.raises(ValueError, match="base_timeout_s must be > 0"):
        EngineLoop(AbortableBaseSyncLLM(CachingEngine()), None, base_timeout_s=0)
