"""The checkpoint directory's rules (pure): the names under ROOT (step-N, latest, .tmp-, .old-), the manifest's
file checks, which directories a load tries and a save cleans, and the crash-injection spec. What is read from a
step directory at another layout is reshard_plan.py's."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

FORMAT = "moe_lora_rl.train_checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
LATEST_TMP = f".{LATEST}.tmp"                     # the next `latest`, written before the renames
TMP_PREFIX = ".tmp-"                             # .tmp-step-N: a save in progress (or a crashed one)
OLD_PREFIX = ".old-"                             # .old-step-N: step-N's previous copy while a resave replaces it
CRASH_ENV = "MOE_LORA_RL_CKPT_CRASH"
CRASH_POINTS = ("before_shards", "between_shards", "after_shards", "before_manifest", "before_rename",
                "mid_replace", "before_latest", "before_cleanup")
"""Where save_checkpoint calls its crash hook, in order (api.py's docstring says what each leaves on disk)."""
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step={step!r} must be an integer >= 0")
    return f"step-{step:08d}"


def step_of(dir_name: str) -> int | None:
    m = _STEP_DIR.match(dir_name)
    return int(m.group(1)) if m else None


class IntegrityError(ValueError):
    """A checkpoint missing, incomplete or corrupted (a load falls back to an older one). Every other ValueError of a
    load is a refusal (another model, LoRA config or optimizer), which never falls back."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def check_file(ckpt: Path, name: str, want: dict) -> None:
    """One manifest entry {"bytes", "sha256"} against the file on disk (ValueError naming the file)."""
    f = ckpt / name
    if not f.is_file():
        raise IntegrityError(f"checkpoint file {f} is missing (listed in {ckpt / MANIFEST})")
    size = f.stat().st_size
    if size != want["bytes"]:
        raise IntegrityError(f"checkpoint file {f} is truncated or altered: {size} bytes, the manifest says "
                         f"{want['bytes']}")
    digest = sha256_file(f)
    if digest != want["sha256"]:
        raise IntegrityError(f"checkpoint file {f} fails its checksum: sha256 {digest[:16]}..., the manifest says "
                         f"{want['sha256'][:16]}...")


def plan_candidates(latest: str | None, complete: set[str]) -> list[str]:
    """The directories a load tries, in order: the one `latest` names (even when incomplete: its error is the
    message), step-N's previous copy .old-step-N (a resave killed between its two renames), then the older complete
    step directories, newest first. `complete`: ROOT's entries holding a manifest. `latest` None (no pointer): []."""
    if latest is None:
        return []
    bound = step_of(latest)
    out = [latest]
    if bound is not None and OLD_PREFIX + latest in complete:
        out.append(OLD_PREFIX + latest)
    older = sorted((s for s in map(step_of, complete) if s is not None and (bound is None or s < bound)),
                   reverse=True)
    return out + [step_dir_name(s) for s in older]


def plan_cleanup(entries: dict[str, bool], latest: str | None) -> list[tuple[str, ...]]:
    """What a save tidies before writing, from ROOT's entries (name -> holds a manifest): ("remove", name) for a
    crashed save's .tmp-step-* and .latest.tmp, for .old-step-N once step-N is complete again, for a step directory
    without manifest unless `latest` names it; ("restore", ".old-step-N", "step-N") where a resave was killed
    between its renames (after ("remove", "step-N") when an incomplete one is in the way). Complete step directories
    are never touched."""
    acts: list[tuple[str, ...]] = []
    restored = set()
    for name in sorted(entries):
        if name.startswith(TMP_PREFIX + "step-") or name == LATEST_TMP:
            acts.append(("remove", name))
        elif name.startswith(OLD_PREFIX) and step_of(name[len(OLD_PREFIX):]) is not None:
            final = name[len(OLD_PREFIX):]
            if entries.get(final) or not entries[name]:
                acts.append(("remove", name))
                continue
            if final in entries:
                acts.append(("remove", final))
            acts.append(("restore", name, final))
            restored.add(final)
    acts += [("remove", n) for n in sorted(entries)
             if step_of(n) is not None and not entries[n] and n != latest and n not in restored]
    return acts


def crash_action(spec: str | None, point: str, rank: int) -> str | None:
    """"exit" or "raise" when SPEC (CRASH_ENV's value: POINT[:exit|:raise][:rankR]) names POINT on this rank, else
    None. ValueError for a point or option it does not know (a typo must not pass for an uncrashed save)."""
    if not spec:
        return None
    name, *opts = spec.split(":")
    if name not in CRASH_POINTS:
        raise ValueError(f"{CRASH_ENV}={spec!r}: unknown crash point {name!r} (one of {', '.join(CRASH_POINTS)})")
    mode, only = "exit", None
    for o in opts:
        if o in ("exit", "raise"):
            mode = o
        elif o.startswith("rank") and o[4:].isdigit():
            only = int(o[4:])
        else:
            raise ValueError(f"{CRASH_ENV}={spec!r}: option {o!r} is none of exit, raise, rankN")
    return mode if name == point and only in (None, rank) else None
