"""The main job's console: our own lines, the progress bar and real errors. Warnings that say nothing to a user of
the run (a dependency telling it has no Apex or Transformer Engine on CPU, deprecations inside dependencies) are
kept out of it by rules on their source module; every warning, shown or not, goes in full to the run's log file.

    route_warnings()                        # first thing in main(): warnings are held until a log file is given
    quiet_progress()                        # transformers' per-file bars (building and warm-starting the model)
    log_warnings_to(out_dir / "warnings-rank0.log")

Called by the entry point only (never at import): a program that imports this package keeps its own warnings.
"""
from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Quiet:
    """Warnings from modules matching `module` (a regex on the warning's module name) whose text matches `message`
    and whose category is one of `categories` (empty: any) go to the log only."""
    module: str
    message: str = ""
    categories: tuple = ()
    why: str = ""

    def matches(self, module: str, text: str, category) -> bool:
        return bool(re.match(self.module, module) and re.search(self.message, text)
                    and (not self.categories or issubclass(category, self.categories)))


QUIET = (
    Quiet(r"megatron\.", r"(Apex|Transformer Engine)( and Apex)? (is|are) not installed",
          why="megatron-core's fallbacks to torch kernels: expected on CPU"),
    Quiet(r"megatron\.", r"deprecated", why="a deprecation inside megatron-core's own config"),
    Quiet(r"moe_lora_rl\.megatron\.cpu_support", r"Converting a tensor with requires_grad=True to a scalar",
          why="megatron-core reads a loss value with .item(); raised by torch through the CPU support shims"),
    Quiet(r"(torch|transformers|vllm|megatron|hydra|omegaconf|tqdm|peft|numpy|safetensors)(\.|$)", "",
          (DeprecationWarning, FutureWarning, PendingDeprecationWarning),
          why="deprecations inside dependencies"),
)


def module_of(filename: str) -> str:
    """The dotted module name of a source file (its path under site-packages or under this repository)."""
    p = Path(filename)
    parts = p.with_suffix("").parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return ".".join(parts[parts.index(anchor) + 1:])
    if "moe_lora_rl" in parts:
        return ".".join(parts[len(parts) - 1 - parts[::-1].index("moe_lora_rl"):])
    return p.stem


def quiet(filename: str, text: str, category) -> Quiet | None:
    mod = module_of(filename)
    return next((q for q in QUIET if q.matches(mod, text, category)), None)


class _Router:
    def __init__(self):
        self.held: list[str] = []
        self.file = None
        self.shown = self.logged = 0

    def show(self, message, category, filename, lineno, file=None, line=None):
        text = warnings.formatwarning(message, category, filename, lineno, line)
        self._log(text)
        if quiet(filename, str(message), category) is None:
            self.shown += 1
            try:
                (file or sys.stderr).write(text)
            except OSError:       # a closed stream: as Python's own showwarning, the warning is not an error
                pass

    def _log(self, text: str) -> None:
        self.logged += 1
        if self.file is None:
            self.held.append(text)
        else:
            self.file.write(text)
            self.file.flush()


_router: _Router | None = None


def route_warnings() -> None:
    """From now on, warnings of this process go through the rules above (each shown once per place, as Python's
    default does)."""
    global _router
    if _router is None:
        _router = _Router()
        warnings.showwarning = _router.show


def log_warnings_to(path) -> Path:
    """Write the warnings held so far, and every later one, to `path` (appended)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if _router is not None and _router.file is None:
        _router.file = open(path, "a")
        for text in _router.held:
            _router.file.write(text)
        _router.file.flush()
        _router.held.clear()
    return path


def quiet_progress() -> None:
    """No progress bars from transformers / huggingface_hub (writing and loading the built-in model's shards at
    its first build and warm start): the run's own bar is the one that says something."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        return
    disable_progress_bars()
