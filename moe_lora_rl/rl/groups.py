"""Which group the producer generates next and whether the trainer may use it, under a staleness bound (pure).

    plan = group_plan(n_train, prompts_per_step, group_size, seed, g)   # group g: its problem and its seeds
    gate = StalenessGate(prompts_per_step, max_staleness, version=v0)
    while gate.may_admit(): gate.admit(g)                              # producer: back-pressure
    gate.staleness(trainer_version, sample_versions) <= k or drop       # trainer: per sample, counted in pushes

Groups are numbered across the run: group g is prompt g % P of step g // P, so the synchronous run's step s is
groups s*P .. s*P+P-1, in the same order, with the same seeds.

The bound. A sample's staleness is counted in pushes (PushClock): the pushes between the version of its oldest
token and the trainer's version at its update. A push carries one rollout batch's optimizer steps (algo.mini_batches
x algo.epochs, fewer when some skipped), so the version may advance by more than 1 per push; counted in pushes,
the bound means the same whatever the number of mini-steps (with one step per push it is the version difference,
`staleness` below). The trainer consumes finished groups in the order they finish, P per update, so a group
admitted as the n-th (counting groups admitted since the loop started, dropped ones not counted) is trained at
update n // P, after n // P pushes (fewer if updates skipped); admitted while the engine serves the version of push
`pushes`, its oldest token is at least of that push. The gate admits it only if n // P <= pushes + k: in order,
nothing admitted can exceed the bound. A group that finishes out of order can still be trained later than planned;
its staleness is checked, and over the bound it is dropped (its place freed, counted), never trained on.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from .schedule import prompt_indices, sample_seed


@dataclass(frozen=True)
class GroupPlan:
    index: int                 # g
    step: int                  # the step it belongs to in the synchronous order
    problem: int               # training-split index of its prompt
    seeds: tuple[int, ...]     # one per sample


def group_plan(n_train: int, prompts_per_step: int, group_size: int, seed: int, g: int) -> GroupPlan:
    step, i = divmod(g, prompts_per_step)
    problem = prompt_indices(n_train, prompts_per_step, step, seed)[i]
    return GroupPlan(g, step, problem, tuple(sample_seed(seed, step, problem, j) for j in range(group_size)))


class PushClock:
    """Adapter versions counted in pushes: the versions served since the loop started, in order (the first: the one
    served at its start, push 0). A version's push is that of the newest served version <= it (None, the base
    model, is version 0). A version older than the loop's start counts each version between it and the start as a
    push (the pushes before the loop are not known; with one version per push that is exact)."""

    def __init__(self, version: int):
        self.versions = [int(version)]

    def serve(self, version: int) -> None:
        if version < self.versions[-1]:
            raise ValueError(f"served version went back from {self.versions[-1]} to {version}")
        if version > self.versions[-1]:
            self.versions.append(int(version))

    @property
    def pushes(self) -> int:
        """Pushes since the loop started."""
        return len(self.versions) - 1

    def push_of(self, version: int | None) -> int:
        v = 0 if version is None else int(version)
        return bisect.bisect_right(self.versions, v) - 1 if v >= self.versions[0] else v - self.versions[0]

    def staleness(self, trainer_version: int, versions) -> int:
        """A sample's staleness in pushes: the trainer version's push minus that of its oldest token."""
        if not len(versions):
            raise ValueError("a sample without token versions")
        return self.push_of(trainer_version) - min(self.push_of(v) for v in versions)


class StalenessGate:
    """The producer's back-pressure and the trainer's per-sample check for one async loop, counted in pushes (not
    thread-safe: the producer holds its own lock around it)."""

    def __init__(self, prompts_per_step: int, max_staleness: int, version: int):
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness} must be >= 1")
        self.per_step, self.k, self.v0 = prompts_per_step, max_staleness, version
        self.clock = PushClock(version)   # the versions the engine served (pushed)
        self.admitted = 0              # groups admitted since the loop started, dropped ones not counted
        self.ahead_max = 0             # the most updates any admitted group was planned ahead of the pushes

    @property
    def served(self) -> int:
        """The version the engine serves (the last pushed)."""
        return self.clock.versions[-1]

    def staleness(self, trainer_version: int, versions) -> int:
        return self.clock.staleness(trainer_version, versions)

    def may_admit(self) -> bool:
        return self.admitted // self.per_step <= self.clock.pushes + self.k

    def admit(self) -> int:
        """Count one admitted group; its planned update (0-based from the loop's start)."""
        if not self.may_admit():
            raise RuntimeError(f"group {self.admitted} admitted past the bound (served version {self.served}, "
                               f"max_staleness {self.k})")
        planned = self.admitted // self.per_step
        self.ahead_max = max(self.ahead_max, planned - self.clock.pushes)
        self.admitted += 1
        return planned

    def dropped(self, n: int = 1) -> None:
        """n admitted groups will not be trained on: their places go to new groups."""
        self.admitted -= n

    def serve(self, version: int) -> None:
        self.clock.serve(version)


def staleness(trainer_version: int, versions) -> int:
    """A sample's staleness in versions: trainer_version minus its oldest token version (None, the base model, is
    version 0); the same as PushClock.staleness while every push advances the version by 1."""
    if not len(versions):
        raise ValueError("a sample without token versions")
    return trainer_version - min(0 if v is None else v for v in versions)
