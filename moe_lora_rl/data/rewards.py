"""The run's reward: a function with verl's signature, computed in worker processes (off the trainer), each call
bounded by reward.timeout_s.

    compute_score(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, ...}

reward.path=null: verl's `default_compute_score` (it dispatches on data_source: openai/gsm8k, MATH, ...) with the
scorers it reads wrong replaced (DEFAULT: integration/verl/reward_score.py; gsm8k's and math_dapo's read the whole
response, not its last 300 characters), and the built-in tasks' sources scored by their own scorer (BUILTIN, a
table); reward.path=FILE or pkg://module with reward.name=FN: the user's function for every row, as verl's
custom_reward_function.

    workers = RewardWorkers(path, name, timeout_s)      # its worker (spawned) starts and loads at the first call
    handle = workers.submit([(example, text), ...])     # returns at once: the calls run in the workers
    scores, extras = workers.collect(handle)            # ValueError, one line, on the first bad call
    workers.drop(handle)                                # or: its results are not wanted (a running call is ended)
    workers.close()

A call that raises, returns anything but a finite number (or a dict with a finite "score"), or runs past the
timeout stops the run with one line naming the data source, the row and the error: never a silent 0. A dict's other
numeric keys are returned per response (extras) and logged as metrics.
"""
from __future__ import annotations

import inspect
import math
from pathlib import Path

DEFAULT = ("pkg://moe_lora_rl.integration.verl.reward_score", "default_compute_score")
"""verl's default_compute_score, with openai/gsm8k and the math_dapo sources read in full (not the last 300
characters): what each data source's default scorer reads is listed in docs/data.md."""
BUILTIN = {src: ("pkg://moe_lora_rl.data.reward", "compute_score")
           for src in ("moe_lora_rl/addition", "moe_lora_rl/sort_trace", "moe_lora_rl/sort_long")}
"""data_source -> the scorer of a built-in task (data/reward.py), used by the default reward before verl's."""
ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def describe(path: str | None, name: str) -> str:
    if path is None:
        return "the default reward: verl's default_compute_score"
    return f"reward.path={path!r} reward.name={name!r}"


def load_function(path: str, name: str):
    """The callable `name` of a module file or pkg://module; ValueError (one line) when the file or module does not
    exist, fails to import, lacks `name`, or `name` does not take verl's arguments."""
    import importlib
    import importlib.util

    where = f"reward.path={path!r}"
    try:
        if path.startswith("pkg://"):
            module = importlib.import_module(path[len("pkg://"):].replace("/", "."))
        else:
            file = Path(path[len("file://"):] if path.startswith("file://") else path)
            if not file.is_file():
                raise ValueError(f"{where}: no such file")
            spec = importlib.util.spec_from_file_location(f"moe_lora_rl_reward_{abs(hash(str(file.resolve())))}",
                                                          file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    except ValueError:
        raise
    except BaseException as e:  # noqa: BLE001  (any error of the user's module, SystemExit included)
        raise ValueError(f"{where} does not import: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{where} has no function reward.name={name!r}")
    if not callable(fn):
        raise ValueError(f"{where}: reward.name={name!r} is a {type(fn).__name__}, not a function")
    check_signature(fn, f"{where} reward.name={name!r}")
    return fn


def check_signature(fn, where: str) -> None:
    """fn takes verl's call, fn(data_source=, solution_str=, ground_truth=, extra_info=)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return                          # a builtin without a signature: its calls will tell
    try:
        sig.bind(**{a: None for a in ARGS})
    except TypeError as e:
        raise ValueError(f"{where}: {fn.__name__}{sig} does not take verl's arguments "
                         f"compute_score(data_source, solution_str, ground_truth, extra_info) ({e})") from None


def check_result(value, data_source: str, index: int, where: str) -> tuple[float, dict]:
    """(score, the dict's other numeric keys) of one call's result; ValueError naming the row otherwise."""
    extras = {}
    score = value
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward ({where}) on data_source {data_source!r} row {index}: returned a dict without "
                             f"'score' (keys {sorted(value)[:8]})")
        score = value["score"]
        extras = {k: float(v) for k, v in value.items()
                  if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if isinstance(score, bool) or not isinstance(score, (int, float)) and not hasattr(score, "__float__"):
        raise ValueError(f"reward ({where}) on data_source {data_source!r} row {index}: returned "
                         f"{type(score).__name__} {score!r:.60}, not a number")
    score = float(score)
    if not math.isfinite(score):
        raise ValueError(f"reward ({where}) on data_source {data_source!r} row {index}: returned {score}, not a "
                         "finite number")
    return score, extras


# -- in the worker process -----------------------------------------------------------------------------------------
_FUNCTIONS: dict = {}


def function_keys(path: str | None, name: str, sources) -> list[tuple[str, str]]:
    """The (path, name) functions that score these data sources."""
    if path is not None:
        return [(path, name)]
    return sorted({BUILTIN.get(s, DEFAULT) for s in sources})


def _load(keys) -> None:
    """A worker's initializer: load the functions once, before any timed call (a load error is kept and reported
    by the calls: an initializer that raises would be restarted for ever)."""
    for key in keys:
        try:
            _FUNCTIONS[key] = load_function(*key)
        except ValueError as e:
            _FUNCTIONS[key] = e


def _ready() -> bool:
    return True


def make_pool(keys, workers: int = 1, load_timeout_s: float = 600.0):
    """A pool of spawned worker processes that have loaded `keys` (verl's import takes seconds: not a call's time)."""
    import multiprocessing as mp

    pool = mp.get_context("spawn").Pool(workers, initializer=_load, initargs=(list(keys),))
    try:
        pool.apply_async(_ready).get(load_timeout_s)
    except mp.TimeoutError:
        pool.terminate()
        raise ValueError(f"the reward workers did not load {list(keys)} within {load_timeout_s:g} s") from None
    return pool


def _function(path, name, data_source):
    """The function scoring data_source (loaded once per worker)."""
    key = (path, name) if path is not None else BUILTIN.get(data_source, DEFAULT)
    if key not in _FUNCTIONS:
        _load([key])
    fn = _FUNCTIONS[key]
    if isinstance(fn, Exception):
        raise fn
    return fn


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The main job's default reward (reward.path=null) as one function with verl's signature: a built-in task's
    source scored by its own scorer (BUILTIN), any other by DEFAULT (verl's default_compute_score, gsm8k and
    math_dapo read in full). For verl's
    reward.custom_reward_function (path=pkg://moe_lora_rl.data.rewards, name=compute_score:
    recipes/verl_moe_lora/run_cpu_smoke.sh's default), so that both routes score every dataset alike."""
    return _function(None, None, data_source)(data_source=data_source, solution_str=solution_str,
                                              ground_truth=ground_truth, extra_info=extra_info)


def call(path, name, data_source, solution_str, ground_truth, extra_info):
    """One reward call in a worker: the raw result, or ("error", text) for any exception (so that the trainer's
    message names the row, and an unpicklable exception cannot take the pool down)."""
    try:
        fn = _function(path, name, data_source)
    except ValueError as e:
        return ("error", str(e))
    try:
        out = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                 extra_info=extra_info)
        if isinstance(out, dict):
            out = {k: v for k, v in out.items() if isinstance(v, (int, float, str, bool, type(None)))}
        elif not isinstance(out, (int, float, bool, type(None))):
            out = repr(out)[:80]          # refused by check_result with its text
        return ("ok", out)
    except NotImplementedError as e:      # verl's default scorer on a data_source it does not know
        return ("error", f"NotImplementedError: {e} (a data_source verl's default_compute_score does not score: set "
                         "reward.path and reward.name to a function that does)")
    except BaseException as e:  # noqa: BLE001
        return ("error", f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")


class Call:
    """One reward call: its row, the response and the worker's pending result (replaced when the pool is)."""
    __slots__ = ("example", "text", "result", "dropped_at")

    def __init__(self, example, text):
        self.example, self.text, self.result, self.dropped_at = example, text, None, None


class RewardWorkers:
    """A pool of reward worker processes (spawned: nothing of the trainer's state is copied into them).

    A call can be dropped (drop(): its sample will not be scored); a pool's worker cannot cancel a running call, so a
    dropped call still running reward.timeout_s after it was dropped (at the next submit), or while a live call waits
    past its timeout (at collect), has the pool terminated (its workers killed) and replaced, the live calls started
    again in the new one. A live call past its timeout with no dropped call left running is the hung one: its row
    is named."""

    def __init__(self, path: str | None, name: str = "compute_score", timeout_s: float = 30.0, workers: int = 1,
                 pool=None):
        self.path, self.name, self.timeout_s, self.workers = path, name, float(timeout_s), int(workers)
        self.where = describe(path, name)
        self._pool = pool                 # a spawned multiprocessing Pool to share (tests); None: its own
        self.replaced = 0                 # pools terminated for dropped calls that kept running
        self._live: set = set()           # calls submitted, not yet collected or dropped
        self._dropped: list = []          # dropped calls that had not finished when last looked at
        import threading

        self._lock = threading.RLock()    # the producer's threads submit too (rl/pipeline.py)

    def pool(self, sources=()):
        """The worker pool, started (and the functions for `sources` loaded) on first use."""
        with self._lock:
            if self._pool is None:
                self._pool = make_pool(function_keys(self.path, self.name, sources), self.workers)
            return self._pool

    def _start(self, pool, c: Call) -> None:
        ex = c.example
        c.result = pool.apply_async(call, (self.path, self.name, ex.data_source, c.text, _plain(ex.ground_truth),
                                           _plain(ex.extra_info)))

    def submit(self, items) -> list[Call]:
        """items: (example, response text) pairs. The calls start at once; collect(handle) waits for them."""
        import time

        with self._lock:
            if any(time.monotonic() - c.dropped_at > self.timeout_s for c in self._running_dropped()):
                self.replace()
            pool = self.pool({ex.data_source for ex, _ in items})
            calls = [Call(ex, text) for ex, text in items]
            for c in calls:
                self._start(pool, c)
            self._live.update(calls)
        return calls

    def drop(self, calls) -> None:
        """Calls whose results will not be collected (any thread); one still running is ended with its pool later."""
        import time

        with self._lock:
            for c in calls:
                self._live.discard(c)
                if not c.result.ready():
                    c.dropped_at = time.monotonic()
                    self._dropped.append(c)

    def _running_dropped(self) -> list[Call]:
        self._dropped = [c for c in self._dropped if not c.result.ready()]
        return self._dropped

    def replace(self) -> None:
        """Terminate the pool (its workers, and any call they run, killed) and start the live calls again in a new
        one."""
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool.join()
                self._pool = None
            self._dropped, self.replaced = [], self.replaced + 1
            live = [c for c in self._live if not c.result.ready()]
            if live:
                pool = self.pool({c.example.data_source for c in live})
                for c in live:
                    self._start(pool, c)

    def _get(self, c: Call):
        import multiprocessing as mp

        for _ in range(2):
            r = c.result
            try:
                return r.get(self.timeout_s)
            except mp.TimeoutError:
                pass
            with self._lock:
                if c.result is not r:     # started again in a new pool meanwhile (another thread's replace)
                    continue
                if not self._running_dropped():
                    break                 # nothing else holds the workers: this call is the hung one
                self.replace()            # dropped calls may hold every worker: they go, this one starts again
        self.close(kill=True)             # the hung call's worker goes with the pool
        raise ValueError(f"reward ({self.where}) on data_source {c.example.data_source!r} row {c.example.index}: no "
                         f"result within reward.timeout_s={self.timeout_s:g}")

    def collect(self, handle) -> tuple[list[float], list[dict]]:
        scores, extras = [], []
        for c in handle:
            kind, value = self._get(c)
            with self._lock:
                self._live.discard(c)
            ex = c.example
            if kind == "error":
                raise ValueError(f"reward ({self.where}) on data_source {ex.data_source!r} row {ex.index}: {value}")
            s, e = check_result(value, ex.data_source, ex.index, self.where)
            scores.append(s)
            extras.append(e)
        return scores, extras

    def score(self, items) -> tuple[list[float], list[dict]]:
        return self.collect(self.submit(items))

    def probe(self, examples) -> None:
        """One call per data_source (its first row, an empty response): the function imports, takes verl's call
        and knows the source (verl's default raises NotImplementedError for one it does not know)."""
        first = {}
        for ex in examples:
            first.setdefault(ex.data_source, ex)
        self.score([(ex, "") for ex in first.values()])

    def close(self, kill: bool = False) -> None:
        with self._lock:
            if self._pool is not None:
                if kill:
                    self._pool.terminate()
                else:
                    self._pool.close()
                self._pool.join()
                self._pool = None
            self._live.clear()
            self._dropped = []


def _plain(v):
    """extra_info as plain Python (the reward gets what verl would hand it: dicts and lists)."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v
