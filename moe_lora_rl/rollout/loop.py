"""The continuously running engine: one thread owns vLLM's in-process `LLMEngine` and steps it; requests are
submitted and their samples delivered as they finish, from any number of client threads; every other engine call
(adapter stages and commits, status, prefix-cache resets) runs in that thread *between two engine steps*, while
other requests are mid-decode.

    loop = EngineLoop(llm, capture_meta, inflight="switch")       # llm: rollout.vllm_engine.make_engine(...)
    loop.start()
    ticket = loop.submit([Request(prompt, params), ...])           # params: vLLM SamplingParams
    for index, result in ticket:                                   # as they finish: Generated, or an Exception
        ...
    gens = loop.generate(requests)                                 # submit + wait, in order (raises the first error)
    loop.call(lambda llm: llm.collective_rpc("moe_lora_status")[0])

Versions. Every response token records the adapter version that produced it (`Generated.versions`): in `switch`
mode the version served at the engine step that sampled it (a commit applies to running requests from their next
forward; their KV cache is kept), in `pin` mode the version the request was tracked with at admission
(worker extension `moe_lora_track`). The prefix cache is keyed by version (vLLM's `cache_salt`), never reset per
commit: a reset cannot drop the blocks of running requests, and `pin` keeps several versions' prefixes live.
A base update (vLLM's start_weight_update / update_weights / finish_weight_update, BASE_METHODS) changes what
every salt means: it is refused while requests run, no request is admitted from start_weight_update until
finish_weight_update (or moe_lora_base_abort) returns, and vLLM's prefix cache is reset after finish_weight_update.
A base update with no start_weight_update or update_weights for base_timeout_s (its sender died between start and
finish) is aborted by the loop (moe_lora_base_abort, one line in the log): the engine keeps its base and admits again.

Commit barrier (switch). A request's prompt must be computed under the version of its salt, so a commit waits
until every admitted request has prefilled (no chunked prefill: one step), and no request is admitted while a
commit waits. Full (pin, on_full=wait): a commit waits while the worker reports `can_commit` false, i.e. until a
pinned request ends and frees a version; on_full=refuse: the commit's own error is returned.

The sync path (one submission with reset_prefix=True on an idle engine) adds its requests in order and steps until
they finish: the same scheduling, seeds and tokens as `LLM.generate` on the same requests.
"""
from __future__ import annotations

import itertools
import threading
import time
import traceback
from concurrent.futures import Future

from .generate import Generated, finish_generated
from .tickets import Live, Request, Ticket

# worker-extension methods that change the served weights: they run behind the commit barrier
COMMIT_METHODS = frozenset({"moe_lora_commit", "moe_lora_push", "moe_lora_push_shm", "moe_lora_push_blob",
                            "moe_lora_clear", "moe_lora_set_mode"})
# vLLM's weight-transfer calls that load a new base (vllm/base_sync.py): refused while requests run, and vLLM's prefix
# cache is reset after finish_weight_update (its blocks, base-salted or unsalted, were computed under the old base)
BASE_METHODS = frozenset({"start_weight_update", "update_weights", "finish_weight_update"})
# of those, the ones that add a version (the only ones that can find the engine full)
ADDING_METHODS = frozenset({"moe_lora_commit", "moe_lora_push", "moe_lora_push_shm", "moe_lora_push_blob"})
# housekeeping skipped (answered None) while a commit waits behind the barrier or a full engine: the stage that commit
# closes is not abandoned, however long it waits
SKIPPED_WHILE_COMMITS_WAIT = frozenset({"moe_lora_expire"})


class _Command:
    def __init__(self, fn, method: str | None):
        self.fn, self.method, self.future = fn, method, Future()
        self.waited_since: float | None = None         # deferred behind the barrier or a full engine since


def _base_timeout(llm, value: float | None) -> float:
    """base_timeout_s: the value given, else the engine's moe_lora_stage_timeout_s (vllm/staged_push.py's default)."""
    from ..vllm.staged_push import DEFAULT_STAGE_TIMEOUT_S, check_stage_timeout

    if value is None:
        extra = getattr(getattr(llm.llm_engine, "vllm_config", None), "additional_config", None) or {}
        value = extra.get("moe_lora_stage_timeout_s", DEFAULT_STAGE_TIMEOUT_S)
    return check_stage_timeout(value, "base_timeout_s")


class EngineLoop:
    def __init__(self, llm, meta: dict | None = None, *, inflight: str = "switch", on_full: str = "wait",
                 pad_routes: bool = False, step_delay_s: float = 0.0, kv_meter=None, kv_records=None,
                 base_timeout_s: float | None = None):
        core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
        if core is not None and getattr(core, "batch_queue", None) is not None:
            raise ValueError("the engine loop needs one batch in flight at a time (vLLM batch queue is enabled)")
        self.llm, self.engine, self.meta = llm, llm.llm_engine, meta
        self.inflight, self.on_full, self.pad = inflight, on_full, pad_routes
        self.kv_meter = kv_meter              # rollout/kv_meter.KVMeter: sampled after every engine step
        self.kv_records = kv_records          # KV replay: request id -> its eviction record (kv_evict.pop_events)
        self.step_delay_s = step_delay_s      # a slower engine (tests, benches): the next step waits this long, while
        self._next_step_at = 0.0              # commands (pushes, status) are still served as between two steps
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._pending: list[tuple[Ticket, list[Request], bool]] = []
        self._commands: list[_Command] = []
        self._live: dict[str, Live] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._base_open = False           # a base update started and not finished or aborted: nothing is admitted
        self._base_touched = 0.0          # time.monotonic() of its last start_weight_update or update_weights
        self.base_timeout_s = _base_timeout(llm, base_timeout_s)
        self.served = self._rpc("moe_lora_status")["version"]
        self.stats = {"steps": 0, "step_s": 0.0, "tokens": 0, "commands": 0, "stall_s": 0.0, "commits": 0,
                      "commit_wait_s": 0.0, "base_expired": 0}

    # -- client side (any thread) -------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(60)

    def submit(self, requests: list[Request], *, reset_prefix: bool = False) -> Ticket:
        """Queue the requests (admitted together, in order, between two steps). reset_prefix: reset vLLM's prefix
        cache before admitting them when no other request is in flight (the sync path's reproducibility)."""
        ticket = Ticket(len(requests))
        if not requests:
            return ticket
        with self._lock:
            self._check_running()
            self._pending.append((ticket, list(requests), reset_prefix))
            self._lock.notify_all()
        return ticket

    def generate(self, requests: list[Request], *, reset_prefix: bool = True) -> list[Generated]:
        """Submit + wait; results in order; the first failed request's error is raised (after all finished)."""
        results = self.submit(requests, reset_prefix=reset_prefix).results()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def call(self, fn, method: str | None = None, timeout: float | None = None):
        """fn(llm) in the engine thread between two steps; its value or its exception. method: the worker method
        fn calls, when it is one of COMMIT_METHODS (the barrier and the full check apply)."""
        cmd = _Command(fn, method)
        with self._lock:
            self._check_running()
            self._commands.append(cmd)
            self._lock.notify_all()
        return cmd.future.result(timeout)

    def rpc(self, method: str, args=(), kwargs=None, timeout: float | None = None):
        """A worker-extension call between two steps: the first worker's result."""
        return self.call(lambda llm: llm.collective_rpc(method, args=tuple(args), kwargs=kwargs or {})[0],
                         method, timeout)

    def abort(self, ticket: Ticket) -> None:
        """Stop the ticket's requests still running (their results are not delivered)."""
        self.call(lambda llm: self._abort(ticket.request_ids))

    def in_flight(self) -> int:
        with self._lock:
            return len(self._live) + sum(len(r) for _, r, _ in self._pending)

    def running(self) -> bool:
        """Commands and submissions are taken (not stopped, and the engine thread, once started, is alive)."""
        return not self._stop and (self._thread is None or self._thread.is_alive())

    def _check_running(self) -> None:
        if self._stop:
            raise RuntimeError("the engine loop is stopped")
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError("the engine loop thread is gone")

    # -- engine thread ------------------------------------------------------------------------------------
    def _rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, args=args)[0]

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._stop or self._commands or self._pending or self._live):
                    self._lock.wait(0.5)
                if self._stop:
                    break
                commands, self._commands = self._commands, []
            deferred = self._run_commands(commands)
            self._expire_base()
            blocked = (bool(deferred) and self.inflight == "switch") or self._base_open
            with self._lock:
                self._commands[:0] = deferred
                pending = [] if blocked else self._pending
                if not blocked:
                    self._pending = []
            for ticket, reqs, reset in pending:
                self._admit(ticket, reqs, reset)
            if self._live:
                wait = self._next_step_at - time.perf_counter()
                if wait > 0:
                    with self._lock:               # deferred commands wait for the step; new ones run now
                        if len(self._commands) <= len(deferred) and not self._stop:
                            self._lock.wait(wait)
                    continue
                self._step()
            elif deferred:
                time.sleep(0.001)
            elif self._base_open:
                with self._lock:                   # admissions wait for the base update; its next call wakes this
                    if not self._commands and not self._stop:
                        self._lock.wait(0.05)
        self._fail_all(RuntimeError("the engine loop stopped"))

    def _expire_base(self) -> None:
        """Abort a base update whose sender made no call for base_timeout_s (it died between start and finish)."""
        idle = time.monotonic() - self._base_touched
        if not self._base_open or idle < self.base_timeout_s:
            return
        self._base_open = False
        self.stats["base_expired"] += 1
        try:
            served = self._rpc("moe_lora_base_abort").get("served")
        except Exception as e:  # noqa: BLE001 - admissions resume whatever the abort says
            served = f"unknown ({type(e).__name__}: {e})"
        print(f"moe_lora: base update aborted: no start_weight_update or update_weights for {idle:.1f} s "
              f"(base_timeout_s {self.base_timeout_s:g}); base version {served} stays served", flush=True)

    def _barrier_open(self) -> bool:
        return self.inflight != "switch" or all(l.started for l in self._live.values())

    def _run_commands(self, commands: list[_Command]) -> list[_Command]:
        deferred = []
        busy = bool(self._live)
        t0 = time.perf_counter()
        for cmd in commands:
            if cmd.method in SKIPPED_WHILE_COMMITS_WAIT and deferred:    # waiting commits come first in a batch
                cmd.future.set_result(None)
                continue
            if cmd.method in COMMIT_METHODS:
                if not self._barrier_open() or (self.on_full == "wait" and cmd.method in ADDING_METHODS
                                                and not self._rpc("moe_lora_status").get("can_commit", True)):
                    if cmd.waited_since is None:
                        cmd.waited_since = t0
                    deferred.append(cmd)
                    continue
            try:
                if cmd.method in BASE_METHODS and self._live:
                    raise ValueError(f"{cmd.method}: a base update while {len(self._live)} requests run is refused "
                                     "(their KV cache and prefix-cache blocks are the old base's); wait for them")
                if cmd.method in ("finish_weight_update", "moe_lora_base_abort"):
                    self._base_open = False               # finished, refused or aborted: admissions resume
                cmd.future.set_result(cmd.fn(self.llm))
                if cmd.method == "start_weight_update":
                    self._base_open = True
                if cmd.method in ("start_weight_update", "update_weights"):
                    self._base_touched = time.monotonic()
                if cmd.method == "finish_weight_update" \
                        and self.engine.vllm_config.cache_config.enable_prefix_caching:
                    self.engine.reset_prefix_cache()
            except BaseException as e:  # noqa: BLE001 - the caller gets it; the loop keeps serving
                cmd.future.set_exception(e)
            finally:
                self.stats["commands"] += 1
                if cmd.method in COMMIT_METHODS:
                    self.served = self._rpc("moe_lora_status")["version"]
                    self.stats["commits"] += 1
                    if cmd.waited_since is not None:
                        self.stats["commit_wait_s"] += t0 - cmd.waited_since
        if busy and len(deferred) < len(commands):
            self.stats["stall_s"] += time.perf_counter() - t0
        return deferred

    def _admit(self, ticket: Ticket, reqs: list[Request], reset: bool) -> None:
        from vllm.sampling_params import RequestOutputKind

        from ..vllm.versions import cache_salt

        ids = [f"r{next(self._ids)}" for _ in reqs]
        try:
            versions = self._rpc("moe_lora_track", [[rid, r.version] for rid, r in zip(ids, reqs)])
        except Exception as e:  # noqa: BLE001 - e.g. a version the engine does not hold: the whole submission
            for i in range(len(reqs)):
                ticket.deliver(i, e)
            return
        if reset and not self._live and self.engine.vllm_config.cache_config.enable_prefix_caching:
            self.engine.reset_prefix_cache()
        added = []
        try:
            for i, (rid, r, v) in enumerate(zip(ids, reqs, versions)):
                params = r.params.clone()
                params.output_kind = RequestOutputKind.DELTA
                self.engine.add_request(rid, {"prompt_token_ids": r.prompt, "cache_salt": cache_salt(v)}, params)
                added.append(rid)
                self._live[rid] = Live(ticket, i, r, v)
        except Exception as e:  # noqa: BLE001
            self._abort(added)
            self._rpc("moe_lora_release", ids)
            for i in range(len(reqs)):
                ticket.deliver(i, e)
            return
        ticket.request_ids = ids

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - every request in flight fails with it; the loop keeps serving
            traceback.print_exc()
            self._fail_live(RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        secs = time.perf_counter() - t0
        self.stats["steps"] += 1
        self.stats["step_s"] += secs + self.step_delay_s     # the delay counts as busy
        if self.kv_meter is not None:
            self.kv_meter.sample(sum(1 for o in outs if o.outputs and o.outputs[0].token_ids), secs)
        if self.step_delay_s:
            self._next_step_at = time.perf_counter() + self.step_delay_s
        finished = []
        for out in outs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            c = out.outputs[0]
            new = list(c.token_ids)
            live.started = True
            live.response += new
            if c.logprobs is not None:
                live.logprobs += [d[t].logprob for t, d in zip(new, c.logprobs)]
            if out.prompt_logprobs is not None and live.prompt_logprobs is None:
                live.prompt_logprobs = out.prompt_logprobs
            live.versions += [live.version if self.inflight == "pin" else self.served] * len(new)
            self.stats["tokens"] += len(new)
            if out.finished:
                live.finish_reason = str(c.finish_reason)
                finished.append(out.request_id)
        if finished:
            self._finish(finished)

    def _finish(self, rids: list[str]) -> None:
        routes, err = {}, None
        if self.meta is not None:
            try:
                routes = self._rpc("moe_lora_capture_pop", rids)
            except Exception as e:  # noqa: BLE001 - pop one by one: a request with incomplete routes fails alone
                err = e
                for rid in rids:
                    try:
                        routes.update(self._rpc("moe_lora_capture_pop", [rid]))
                    except Exception as e1:  # noqa: BLE001
                        routes[rid] = e1
        self._rpc("moe_lora_release", rids)
        for rid in rids:
            live = self._live.pop(rid)
            r = routes.get(rid)
            if isinstance(r, BaseException):
                live.ticket.deliver(live.index, RuntimeError(f"routing capture: {r}"))
                continue
            try:
                g = finish_generated(rid, live.req.prompt, live.req.params, live.response, live.logprobs,
                                     live.prompt_logprobs, live.finish_reason, r, self.meta, self.pad)
                g.versions = list(live.versions)
                if self.kv_records is not None:
                    g.kv_kept = self.kv_records(rid)
                live.ticket.deliver(live.index, g)
            except Exception as e:  # noqa: BLE001
                live.ticket.deliver(live.index, e if err is None else RuntimeError(f"routing capture: {err}"))

    def _abort(self, rids) -> None:
        rids = [r for r in rids if r in self._live]
        if not rids:
            return
        self.engine.abort_request(rids)
        for rid in rids:
            self._live.pop(rid, None)
        if self.meta is not None:
            for rid in rids:
                try:
                    self._rpc("moe_lora_capture_pop", [rid])
                except Exception:  # noqa: BLE001 - nothing captured yet
                    pass
        if self.kv_records is not None:
            for rid in rids:
                self.kv_records(rid)                    # dropped with the request
        self._rpc("moe_lora_release", rids)

    def _fail_live(self, err: BaseException) -> None:
        lives, self._live = self._live, {}
        try:
            self.engine.abort_request(list(lives))
            self._rpc("moe_lora_release", list(lives))
        except Exception:  # noqa: BLE001
            pass
        for live in lives.values():
            live.ticket.deliver(live.index, err)

    def _fail_all(self, err: BaseException) -> None:
        self._fail_live(err)
        with self._lock:
            pending, self._pending = self._pending, []
            commands, self._commands = self._commands, []
        for ticket, reqs, _ in pending:
            for i in range(len(reqs)):
                ticket.deliver(i, err)
        for cmd in commands:
            if not cmd.future.done():
                cmd.future.set_exception(err)
