"""An engine that dies during a collective step: rank 0 restarts it (and any other engine found dead), every rank
pushes the current adapter version to the engines that lack it, and the step is repeated, up to engine_restarts
times. GRPORun (rl/run.py) takes these methods; they use its cfg, rank, log, engines, policy, push and
engine_version."""
from __future__ import annotations

import torch.distributed as dist

from .survivor import _died


def broadcast(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


class EngineRecovery:
    """The crash recovery of the run's engines (every rank calls these together)."""

    def _on_engine(self, what: str, fn, after_restart=None):
        """fn() on rank 0's engines, its result on every rank. If an engine process died, that engine is restarted,
        the current adapter version pushed to it again (every rank takes part), after_restart() run on rank 0 and fn
        repeated (fn keeps what the other engines finished), up to engine_restarts times. after_restart(index): rank 0,
        once the restarted engine serves the current version."""
        from ..rollout.client import EngineDied

        for attempt in range(self.cfg.engine_restarts + 1):
            result = None
            if self.rank == 0:
                try:
                    result = ("ok", fn())
                except EngineDied as e:
                    result = _died(e)
                except Exception as e:  # noqa: BLE001 - every rank must learn it, or the others wait forever
                    result = ("error", e)
            kind, value = broadcast(result)
            if kind == "ok":
                return value
            if kind == "error":
                if self.rank == 0:
                    raise value
                if isinstance(value, ValueError):     # a user's error (a bad reward, a prompt): the same one line
                    raise ValueError(str(value))
                raise RuntimeError(f"rank 0 failed during {what}: {value}")
            self._restart(what, value, attempt, after_restart)

    def _restart(self, what: str, died: tuple, attempt: int, after_restart=None) -> int:
        """Every rank: restart the dead engine (rank 0; died = (why, its index)) and any other engine found dead,
        push the current version to every engine that does not serve it (the restarted ones; after a failed push,
        those it did not reach), then after_restart(i) on rank 0 for each restarted engine; or give up once
        engine_restarts is spent. The bytes pushed."""
        why, index = died
        if attempt == self.cfg.engine_restarts:
            raise RuntimeError(f"the rollout engine died during {what} {attempt + 1} times "
                               f"(engine_restarts={self.cfg.engine_restarts}); giving up: {why}")
        which = f"rollout engine {index}" if self.cfg.rollout.engines > 1 else "rollout engine"
        self.log.note(f"{which} died during {what}: {why}; restarting it "
                      f"({attempt + 1}/{self.cfg.engine_restarts}), pushing adapter version "
                      f"{self.policy.version}, repeating {what}")
        self.engine_restarts += 1
        lagging, restarted = self._revive(index)
        pushed = self.push(restarts=False, engines=lagging) if lagging else 0
        if self.rank == 0 and after_restart is not None:
            for i in restarted:
                after_restart(i)
        return pushed

    def _revive(self, index: int) -> tuple[list[int], list[int]]:
        """Rank 0 restarts engine `index` and every other engine that no longer answers; every rank learns which
        engines do not serve the current version and which were restarted (or rank 0's error, raised everywhere)."""
        from ..rollout.client import EngineDied

        result = None
        if self.rank == 0:
            try:
                synced = len(self.engines[index].base_syncs)
                self.engines.restart(index)
                for t in self.engines[index].base_syncs[synced:]:
                    if "peer_port" in t:
                        self.log.note(f"rollout engine {index} took the base from the live engine on port "
                                      f"{t['peer_port']} ({t['bytes'] / 1e6:.1f} MB in {t['total_s']:.2f} s)")
                restarted, lagging = [index], []
                for i, e in enumerate(self.engines):
                    try:
                        served = e.status().get("version")
                    except EngineDied:
                        self.log.note(f"rollout engine {i} is gone too; restarting it")
                        e.restart()
                        restarted.append(i)
                        served = None
                    if self.policy.version > 0 and served != self.engine_version():
                        lagging.append(i)
                result = ("ok", (lagging, restarted))
            except Exception as e:  # noqa: BLE001 - every rank must learn it, or the others wait forever
                result = ("error", e)
        kind, value = broadcast(result)
        if kind == "error":
            raise value if self.rank == 0 else RuntimeError(f"rank 0 failed to restart the rollout engine: {value}")
        return value
