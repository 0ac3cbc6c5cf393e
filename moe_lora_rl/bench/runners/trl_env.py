"""TRL's environment for bench peers: `.venv-trl`, a venv that sees the main environment's packages (a .pth line)
and adds TRL alone (--no-deps: its requirements are the main environment's), so TRL neither changes the main
environment nor brings versions of its own. Not part of CI: the bench sets it up on first use."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

TRL_VERSION = "1.16.0"
ROOT = Path(__file__).resolve().parents[3]


class PeerUnavailable(RuntimeError):
    """A peer that is not installed or fails to start: the message says which and why, in one line."""


def _site(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def ensure(env_dir: Path | None = None) -> Path:
    """The python of TRL's environment, creating it (and installing trl==TRL_VERSION) if needed."""
    env_dir = env_dir or ROOT / ".venv-trl"
    py = env_dir / "bin" / "python"
    probe = [str(py), "-c", "import trl, peft; print(trl.__version__)"]
    if py.exists() and subprocess.run(probe, capture_output=True, text=True).stdout.strip() == TRL_VERSION:
        return py
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True,
                           capture_output=True, text=True)
        (Path(_site(py)) / "moe_lora_rl_main_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", _site(py),
                        f"trl=={TRL_VERSION}"], check=True, capture_output=True, text=True, timeout=600)
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or e.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailable(f"trl: could not set up {env_dir} ({tail[0]})") from None
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"trl: installing trl=={TRL_VERSION} into {env_dir} took over 600 s") from None
    got = subprocess.run(probe, capture_output=True, text=True)
    if got.returncode != 0 or got.stdout.strip() != TRL_VERSION:
        why = (got.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeerUnavailable(f"trl: {py} does not import trl {TRL_VERSION} ({why})")
    return py
