"""Importance-based KV eviction inside vLLM's CPU engine (kv_select.py decides, this moves):

    ev = install(llm, EvictPolicy(budget=96))      # in-process engine, prefix caching off; one per engine
    ... llm.generate(...) / the engine loop ...
    ev.events[req_id]                               # keep_events=True (the checks, KV replay): [(seq_len, [per
                                                    # layer [kv_heads][compacted] positions])] per compression
    ev.pop_events(req_id)                           # a finished request's record for the trainer (KV replay)
    ev.stats()                                      # compressions, blocks freed, deferred, restarts

A sequence's KV lives in its vLLM blocks in two regions. The compacted region is its first blocks: slot i of KV
head h holds that head's i-th kept token (the sinks and the tokens chosen by score, in position order), so each
head keeps its own tokens in the same slots. The open region holds the tokens from `open_start` on at their usual
slots (vLLM keeps writing new tokens there). A compression, at the end of a step, runs in each attention layer's
forward once that layer's output is computed: it scores the held tokens with the sequence's last `window` queries,
gathers the kept ones, writes them into the compacted region, and moves `open_start` to the first recent position.
After the step the blocks between the two regions go back to vLLM's pool through the scheduler's own block
manager (`_remove_blocks_in_range`: null blocks in the request's table, as vLLM's sliding window frees them), so
the allocator counts what a sequence really holds.

Attention of a compressed sequence: vLLM's kernel still runs for the whole batch (it cannot read two regions), and
this module overwrites the compressed sequences' rows with softmax attention over the compacted slots and the
open region, in fp32. Keys are read and written in the CPU kernel's cache layout, which is checked against the
step's own keys on the first step (a kernel with another layout is refused, not misread).

Needs: vLLM 0.32 in this process, prefix caching off (compaction rewrites blocks in place, which shared prefix
blocks cannot take), full attention without soft cap, ALiBi or learned sinks, one KV cache group. A sequence that
vLLM preempts restarts dense (its state is dropped, counted in `restarts`).
"""
from __future__ import annotations

import torch

from .kv_select import EvictPolicy, compress_due, fits, restart_events, scores, select
from .step_hooks import add_listener, remove_listener


class _Seq:
    """One sequence's regions: `compacted` slots (0 before the first compression), the first open position, the
    positions each layer's heads keep, steps since the last compression; `slot`: its row of the query buffers."""

    def __init__(self, layers: int, slot: int):
        self.compacted = 0
        self.open_start = 0
        self.kept: list[torch.Tensor | None] = [None] * layers        # [kv_heads, compacted] positions
        self.since: int | None = None
        self.slot = slot


class _Row:
    __slots__ = ("req", "seq", "q0", "q1", "seq_len", "compressed", "due")

    def __init__(self, req, seq, q0, q1, seq_len, compressed, due):
        self.req, self.seq, self.q0, self.q1, self.seq_len = req, seq, q0, q1, seq_len
        self.compressed, self.due = compressed, due


class KVEvictor:
    def __init__(self, runner, scheduler, pol: EvictPolicy, keep_events: bool = False):
        self.runner, self.pol, self.keep_events = runner, pol, keep_events
        self.mgr = _single_manager(scheduler)
        self.block_size = self.mgr.block_size
        self.layers = _attention_layers(runner.model)
        self.seqs: dict[str, _Seq] = {}
        self.events: dict[str, list] = {}
        self.rows: list[_Row] | None = None
        slots = runner.input_batch.max_num_reqs
        self.free_slots = list(range(slots - 1, -1, -1))
        # the last `window` queries of every running sequence, per layer, in a ring by position (-1: none yet)
        self.obs_q: list[torch.Tensor | None] = [None] * len(self.layers)    # [slots, window, heads, d], lazily
        self.obs_pos = torch.full((slots, pol.window), -1, dtype=torch.long)
        self.layout_checked = False
        self.n_compressions = self.n_freed = self.n_deferred = self.n_restarts = self.n_sequences = 0
        self._orig = {}
        for i, layer in enumerate(self.layers):
            _check_impl(layer.impl, layer.layer_name)
            self._orig[i] = layer.impl.forward
            layer.impl.forward = self._wrap(i, layer.impl.forward)
        add_listener(runner, self)

    def remove(self) -> None:
        remove_listener(self.runner, self)
        for i, layer in enumerate(self.layers):
            layer.impl.forward = self._orig[i]

    def pop_events(self, request_id: str) -> dict:
        """KV replay: a finished request's record {"recent", "events": [[seq_len, per layer [kv_heads][kept]
        positions], ...]} (policy/kv_masks.py), removed here. vLLM's runner may suffix the request id."""
        rid = next((k for k in self.events if k == request_id or k.startswith(f"{request_id}-")), None)
        events = [] if rid is None else self.events.pop(rid)
        return {"recent": self.pol.recent, "events": [[s, kept] for s, kept in events]}

    def stats(self) -> dict:
        return {"compressions": self.n_compressions, "blocks_freed": self.n_freed, "deferred": self.n_deferred,
                "restarts": self.n_restarts, "sequences": self.n_sequences}

    # -- step listener -----------------------------------------------------------------------------------------

    def before(self, info) -> None:
        live = self.runner.requests
        for rid in [r for r in self.seqs if r not in live]:
            self.free_slots.append(self.seqs.pop(rid).slot)
        rows = []
        for i, rid in enumerate(info.req_ids):
            q0, q1 = int(info.query_start_loc[i]), int(info.query_start_loc[i + 1])
            computed = int(info.num_computed_tokens[i])
            seq = self.seqs.get(rid)
            if seq is not None and computed == 0:              # preempted and recomputed from the start: dense again
                self.n_restarts += 1
                if self.events.get(rid):                       # the queries before kept their compressions
                    ev = self.events[rid]
                    self.events[rid] = restart_events(ev, q1 - q0, self.pol.recent, len(self.layers), len(ev[0][1][0]))
                seq = self.seqs[rid] = _Seq(len(self.layers), seq.slot)
                self.obs_pos[seq.slot] = -1
            if seq is None:
                seq = self.seqs[rid] = _Seq(len(self.layers), self.free_slots.pop())
                self.obs_pos[seq.slot] = -1
                self.n_sequences += 1
            seq_len = computed + (q1 - q0)
            w = min(self.pol.window, q1 - q0)
            opos = torch.arange(seq_len - w, seq_len)
            self.obs_pos[seq.slot, opos % self.pol.window] = opos
            held = seq.compacted + seq_len - seq.open_start
            due = compress_due(self.pol, held, seq.since)
            if due and not fits(self.pol, seq_len, self.block_size):
                due = False
                self.n_deferred += 1
            if seq.compacted and q1 - q0 != 1:
                raise RuntimeError(f"kv eviction: request {rid} computes {q1 - q0} tokens in one step after its "
                                   f"compression (expected 1: a decode step)")
            rows.append(_Row(rid, seq, q0, q1, seq_len, bool(seq.compacted), due))
        self.rows = rows
        w = self.pol.window
        n = [min(w, r.q1 - r.q0) for r in rows]
        idx = torch.cat([torch.arange(r.q1 - k, r.q1) for r, k in zip(rows, n)])
        self.obs_idx = (torch.repeat_interleave(torch.tensor([r.seq.slot for r in rows]), torch.tensor(n)),
                        torch.cat([torch.arange(r.seq_len - k, r.seq_len) for r, k in zip(rows, n)]) % w, idx)
        comp = [r for r in rows if r.compressed]
        self.comp = None if not comp else {
            "b": torch.tensor([i for i, r in enumerate(rows) if r.compressed]),
            "q": torch.tensor([r.q0 for r in comp]), "open": torch.tensor([r.seq.open_start for r in comp]),
            "len": torch.tensor([r.seq_len for r in comp])}

    def after(self, info) -> None:
        rows, self.rows = self.rows, None
        if rows is None or info.failed:
            return
        bs = self.block_size
        for r in rows:
            seq = r.seq
            if r.due:
                first = -(-self.pol.compacted // bs)
                last = (r.seq_len - self.pol.recent) // bs
                before = self.mgr.block_pool.get_num_free_blocks()
                self.mgr._remove_blocks_in_range(r.req, first, last)
                self.n_freed += self.mgr.block_pool.get_num_free_blocks() - before
                seq.compacted = self.pol.compacted
                seq.open_start = r.seq_len - self.pol.recent
                seq.since = 0
                self.n_compressions += 1
                if self.keep_events:
                    self.events.setdefault(r.req, []).append((r.seq_len, [k.tolist() for k in seq.kept]))
            elif seq.since is not None:
                seq.since += 1

    # -- attention -----------------------------------------------------------------------------------------------

    def _wrap(self, li: int, orig):
        def forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            out = orig(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            if attn_metadata is None or self.rows is None:
                return out
            cache = _Cache(kv_cache)
            if not self.layout_checked:
                cache.check(key, attn_metadata.slot_mapping[: key.shape[0]])
                self.layout_checked = True
            table = attn_metadata.block_table
            self._observe(li, query)
            if self.comp is not None:
                self._attend_compressed(query, cache, table, output, layer.impl.scale)
            for b, r in enumerate(self.rows):
                if r.due:
                    k, v, pos = self._held(li, r, cache, table[b])
                    self._compress(li, r, cache, table[b], k, v, pos, layer.impl.scale)
            return out
        return forward

    def _observe(self, li: int, query: torch.Tensor) -> None:
        """Each sequence's queries of this step into its ring of the last `window` (indices from `before`)."""
        if self.obs_q[li] is None:
            self.obs_q[li] = torch.zeros((self.obs_pos.shape[0], self.pol.window, *query.shape[1:]),
                                         dtype=torch.float32)
        slots, ring, idx = self.obs_idx
        self.obs_q[li][slots, ring] = query[idx].float()

    def _attend_compressed(self, query, cache: "_Cache", table, output, scale: float) -> None:
        """The compressed sequences' attention, batched over whole blocks: each row's compacted blocks and the
        blocks of its open region, padded to the most blocks and masked to the slots it holds."""
        c, bs = self.comp, self.block_size
        rt = table[c["b"]]                                                    # [B, blocks]
        cblocks = -(-self.pol.compacted // bs)
        first, last = c["open"] // bs, (c["len"] - 1) // bs
        nopen = int((last - first).max()) + 1
        oidx = torch.minimum(first[:, None] + torch.arange(nopen), last[:, None])          # [B, nopen]
        blocks = torch.cat([rt[:, :cblocks], torch.gather(rt, 1, oidx)], 1)            # [B, nb]
        pos = torch.cat([torch.arange(cblocks * bs).expand(len(rt), -1),                # slot index (compacted)
                         (oidx[:, :, None] * bs + torch.arange(bs)).reshape(len(rt), -1)], 1)
        held = torch.cat([pos[:, :cblocks * bs] < self.pol.compacted,
                          (pos[:, cblocks * bs:] >= c["open"][:, None]) & (pos[:, cblocks * bs:] < c["len"][:, None])
                          & (torch.arange(nopen).repeat_interleave(bs) <= (last - first)[:, None])], 1)
        nb = blocks.shape[1]
        k = cache.k.index_select(0, blocks.reshape(-1)).reshape(len(rt), nb, *cache.k.shape[1:])  # [B,nb,kvh,d,bs]
        v = cache.v.index_select(0, blocks.reshape(-1)).reshape(len(rt), nb, *cache.v.shape[1:])  # [B,nb,kvh,bs,d]
        q = query[c["q"]]
        bsz, heads, d = q.shape
        kvh = k.shape[2]
        qg = q.reshape(bsz, kvh, heads // kvh, d).to(k.dtype)
        logits = torch.einsum("bhgd,bnhds->bhgns", qg, k).float().reshape(bsz, kvh, heads // kvh, -1) * scale
        p = torch.softmax(logits.masked_fill(~held[:, None, None, :], float("-inf")), -1)
        p = p.reshape(bsz, kvh, heads // kvh, nb, bs).to(v.dtype)
        output[c["q"]] = torch.einsum("bhgns,bnhsd->bhgd", p, v).reshape(bsz, heads, d).to(output.dtype)

    def _held(self, li: int, r: _Row, cache: "_Cache", row_table: torch.Tensor):
        """Keys, values [kv_heads, n, d] and positions [kv_heads, n] of every token the sequence holds after this
        step's write: the compacted slots, then the open region in position order."""
        seq, bs = r.seq, self.block_size
        opos = torch.arange(seq.open_start, r.seq_len)
        k, v = cache.read(row_table[opos // bs], opos % bs)                   # [kvh, n_open, d]
        pos = opos.expand(k.shape[0], -1)
        if seq.compacted:
            slots = torch.arange(seq.compacted)
            ck, cv = cache.read(row_table[slots // bs], slots % bs)
            k, v, pos = torch.cat([ck, k], 1), torch.cat([cv, v], 1), torch.cat([seq.kept[li], pos], 1)
        return k, v, pos

    def _compress(self, li, r: _Row, cache: "_Cache", row_table, k, v, pos, scale) -> None:
        seq, bs = r.seq, self.block_size
        have = self.obs_pos[seq.slot] >= 0
        s = scores(self.obs_q[li][seq.slot][have], self.obs_pos[seq.slot][have], k, pos, scale)
        kept = select(s, pos, self.pol, r.seq_len)                            # [kvh, compacted]
        idx = torch.searchsorted(pos.contiguous(), kept.contiguous())        # each head's positions are sorted
        kk = torch.gather(k, 1, idx[..., None].expand(-1, -1, k.shape[-1]))
        vv = torch.gather(v, 1, idx[..., None].expand(-1, -1, v.shape[-1]))
        slots = torch.arange(kept.shape[1])
        cache.write(row_table[slots // bs], slots % bs, kk, vv)
        seq.kept[li] = kept


class _Cache:
    """One layer's KV cache in the CPU attention kernel's layout: [blocks, kv_heads, block_size, 2 * d] where,
    per block and head, the keys are stored transposed ([d, block_size]) and the values as [block_size, d]."""

    def __init__(self, kv_cache: torch.Tensor):
        nb, kvh, bs, d2 = kv_cache.shape
        d = d2 // 2
        flat = kv_cache.view(nb, kvh, 2, bs * d)
        self.k = flat[:, :, 0].view(nb, kvh, d, bs)
        self.v = flat[:, :, 1].view(nb, kvh, bs, d)

    def read(self, blocks: torch.Tensor, offs: torch.Tensor):
        """[kv_heads, n, d] keys and values at (blocks[i], offs[i])."""
        return (self.k[blocks, :, :, offs].permute(1, 0, 2), self.v[blocks, :, offs].permute(1, 0, 2))

    def write(self, blocks, offs, k: torch.Tensor, v: torch.Tensor) -> None:
        """Per head h, slot i gets k[h, i] and v[h, i] (this head's i-th kept token)."""
        self.k[blocks, :, :, offs] = k.permute(1, 0, 2).to(self.k.dtype)
        self.v[blocks, :, offs] = v.permute(1, 0, 2).to(self.v.dtype)

    def check(self, key: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        bs = self.k.shape[-1]
        got, _ = self.read(slot_mapping // bs, slot_mapping % bs)
        if not torch.equal(got.permute(1, 0, 2), key.to(got.dtype)):
            raise RuntimeError("kv eviction: the CPU attention kernel's key cache layout is not the transposed "
                               "[d, block_size] one this module reads; refusing to evict from it")


def _attention_layers(model) -> list:
    from vllm.model_executor.layers.attention.attention import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError("kv eviction: the model has no attention layers vLLM's Attention runs")
    return layers


def _check_impl(impl, name: str) -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    if not isinstance(impl, CPUAttentionBackendImpl):
        raise ValueError(f"kv eviction: layer {name} runs {type(impl).__name__}, not vLLM's CPU attention")
    bad = {"sliding_window": impl.sliding_window != -1, "alibi": impl.alibi_slopes is not None,
           "logits soft cap": bool(impl.logits_soft_cap), "learned sinks": impl.sinks is not None}
    if any(bad.values()):
        raise ValueError(f"kv eviction: layer {name} uses {[k for k, b in bad.items() if b]}, which importance "
                         f"eviction does not handle")


def _single_manager(scheduler):
    mgrs = scheduler.kv_cache_manager.coordinator.single_type_managers
    if len(mgrs) != 1:
        raise ValueError(f"kv eviction: the engine has {len(mgrs)} KV cache groups; one (full attention) is handled")
    if scheduler.kv_cache_manager.enable_caching:
        raise ValueError("kv eviction needs prefix caching off: compaction rewrites blocks in place")
    return mgrs[0]


def install(llm, pol: EvictPolicy, keep_events: bool = False) -> KVEvictor:
    """The evictor on an in-process engine (rollout/engine.make_engine with prefix_caching=False). keep_events: log
    every compression's kept positions (for the reference; a serving engine keeps none)."""
    from .compat import check_vllm_version

    check_vllm_version("kv eviction")
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    if core is None:
        raise RuntimeError("kv eviction needs the engine core in this process (set_engine_env before vLLM)")
    if core.async_scheduling:
        raise ValueError("kv eviction needs synchronous scheduling (blocks are freed between two steps)")
    return KVEvictor(core.model_executor.driver_worker.worker.model_runner, core.scheduler, pol, keep_events)
