"""What a submission to the engine loop (loop.py) is: its requests, the ticket its results come back on, and the
record of each request while the engine runs it.

    ticket = loop.submit([Request(prompt, params, version), ...])
    for index, result in ticket: ...                 # as they finish: Generated, or an Exception
    ticket.results()                                 # all of them, in order
"""
from __future__ import annotations

import queue
from dataclasses import dataclass, field


@dataclass
class Request:
    prompt: list[int]
    params: object                     # vllm.SamplingParams (the loop sets output_kind to DELTA)
    version: int | None = None         # pin: the held version to serve it with (None: the newest)


@dataclass
class Live:
    """A request the engine runs: its ticket and index there, and what it has produced so far."""
    ticket: "Ticket"
    index: int
    req: Request
    version: int | None = None
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list | None = None
    versions: list = field(default_factory=list)
    started: bool = False
    finish_reason: str = ""


class Ticket:
    """The results of one submission: iterate for (index, Generated | Exception) as requests finish."""

    def __init__(self, n: int):
        self.n, self._q, self._given = n, queue.Queue(), 0
        self.request_ids: list[str] = []

    def deliver(self, index: int, result) -> None:
        """The engine thread hands request `index`'s result (a Generated or an Exception) to the reader."""
        self._q.put((index, result))

    def __iter__(self):
        return self

    def __next__(self):
        if self._given == self.n:
            raise StopIteration
        item = self._q.get()
        self._given += 1
        return item

    def results(self) -> list:
        out = [None] * self.n
        for i, r in self:
            out[i] = r
        return out
