"""Which group the producer generates next and whether the trainer may use it, under a staleness bound (pure).

    plan = group_plan(n_train, prompts_per_step, group_size, seed, g)   # group g: its problem and its seeds
    gate = StalenessGate(prompts_per_step, max_staleness, version=v0)
    while gate.may_admit(): gate.admit(g)                              # producer: back-pressure
    staleness(trainer_version, sample_versions) <= k or drop            # trainer: per sample

Groups are numbered across the run: group g is prompt g % P of step g // P, so the synchronous run's step s is
groups s*P .. s*P+P-1, in the same order, with the same seeds.

The bound. A sample's staleness is the trainer's version at its update minus the oldest version among its tokens.
The trainer consumes finished groups in the order they finish, P per update, so a group admitted as the n-th
(counting groups admitted since the loop started, dropped ones not counted) is trained at update n // P, at version
v0 + n // P; admitted while the engine serves version `served`, its oldest token is at least `served`. The gate
admits it only if n // P <= served - v0 + k: in order, nothing admitted can exceed the bound. A group that finishes
out of order can still be trained later than planned; its staleness is checked, and over the bound it is dropped
(its place freed, counted), never trained on.
"""
from __future__ import annotations

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


class StalenessGate:
    """The producer's back-pressure and the trainer's per-sample check for one async loop (not thread-safe: the
    producer holds its own lock around it)."""

    def __init__(self, prompts_per_step: int, max_staleness: int, version: int):
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness} must be >= 1")
        self.per_step, self.k, self.v0 = prompts_per_step, max_staleness, version
        self.served = version          # the version the engine serves (pushed)
        self.admitted = 0              # groups admitted since the loop started, dropped ones not counted
        self.ahead_max = 0             # the most updates any admitted group was planned ahead of `served`

    def may_admit(self) -> bool:
        return self.admitted // self.per_step <= self.served - self.v0 + self.k

    def admit(self) -> int:
        """Count one admitted group; its planned update (0-based from the loop's start)."""
        if not self.may_admit():
            raise RuntimeError(f"group {self.admitted} admitted past the bound (served version {self.served}, "
                               f"max_staleness {self.k})")
        planned = self.admitted // self.per_step
        self.ahead_max = max(self.ahead_max, planned - (self.served - self.v0))
        self.admitted += 1
        return planned

    def dropped(self, n: int = 1) -> None:
        """n admitted groups will not be trained on: their places go to new groups."""
        self.admitted -= n

    def serve(self, version: int) -> None:
        if version < self.served:
            raise ValueError(f"served version went back from {self.served} to {version}")
        self.served = version



def staleness(trainer_version: int, versions) -> int:
    """A sample's staleness: trainer_version minus its oldest token version (None, the base model, is version 0)."""
    if not len(versions):
        raise ValueError("a sample without token versions")
    return trainer_version - min(0 if v is None else v for v in versions)
