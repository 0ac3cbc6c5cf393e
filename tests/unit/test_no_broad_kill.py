"""Nothing the project runs stops processes it did not start: run_cpu_smoke.sh past its TIMEOUT ends its own run's
processes (its session, moe_lora_rl/procs.py) and leaves another Ray instance of the user running; and no broad kill
(Ray's stop command, pkill, killall, kill of pid -1, fuser -k) is left in the tree."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = "fake-raylet-68"

# the run: it starts a process that leaves its process group and ignores SIGTERM (as Ray's workers are in groups
# of their own), writes its pid, then waits for the timeout
FAKE_MAIN = f"""
import os, subprocess, sys, time
child = ("import os, signal, time; os.setpgid(0, 0); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "open(os.environ['LEFTOVER'], 'w').write(str(os.getpid())); time.sleep(300)")
subprocess.Popen([sys.executable, "-c", child, "{MARK}"])
time.sleep(300)
"""
# Ray's stop: every process of this user whose command line has Ray's names (here: MARK)
FAKE_RAY_STOP = f"""
import os, signal
for p in filter(str.isdigit, os.listdir("/proc")):
    try:
        if b"{MARK}" in open(f"/proc/{{p}}/cmdline", "rb").read() and int(p) != os.getpid():
            os.kill(int(p), signal.SIGKILL)
    except OSError:
        pass
"""


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_smoke_timeout_ends_its_run_and_nothing_else(tmp_path):
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("{}")
    (tmp_path / "main.py").write_text(FAKE_MAIN)
    (tmp_path / "ray_stop.py").write_text(FAKE_RAY_STOP)
    calls, leftover = tmp_path / "ray_calls.log", tmp_path / "leftover.pid"
    stubs = {  # python: the real one, but the recipe's driver is FAKE_MAIN; ray (next to python): recorded
        "python": f'case "$1" in */main_verl_moe_lora.py) exec "{sys.executable}" "{tmp_path}/main.py";; esac\n'
                  f'exec "{sys.executable}" "$@"',
        "ray": f'echo "$*" >> "{calls}"; [ "$1" = stop ] && "{sys.executable}" "{tmp_path}/ray_stop.py"; exit 0',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    # another Ray instance of the user's: not started by the script, must outlive its timeout
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", MARK], start_new_session=True)
    try:
        env = os.environ | {"PYTHON": str(bin_dir / "python"), "TIMEOUT": "3", "PROMPT_LEN": "32", "MODEL": "unused",
                            "LEFTOVER": str(leftover), "PYTHONPATH": str(ROOT)}
        t0 = time.monotonic()
        r = subprocess.run(["bash", str(ROOT / "recipes/verl_moe_lora/run_cpu_smoke.sh"), str(out),
                            "data.train_files=unused.parquet"], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 124, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
        assert "SMOKE: stopped (rc=124)" in r.stdout and time.monotonic() - t0 < 60
        assert leftover.exists(), (out / "run.log").read_text()[-2000:]
        pid = int(leftover.read_text())
        for _ in range(50):                                      # SIGKILLed: gone once its parent reaps it
            if not _alive(pid):
                break
            time.sleep(0.1)
        assert not _alive(pid), f"the run's own process {pid} outlived its timeout"
        ray_calls = calls.read_text().splitlines() if calls.exists() else []
        killed = sentinel.poll()                                 # None: the user's other Ray is still running
        assert killed is None and not any(c.startswith("stop") for c in ray_calls), \
            f"a process the script did not start ended with {killed}; the script ran ray {ray_calls}"
    finally:
        sentinel.kill()
        sentinel.wait()
        if leftover.exists() and _alive(int(leftover.read_text())):
            os.kill(int(leftover.read_text()), 9)


BROAD_KILLS = [re.compile(p) for p in (
    r"\bray[\"',\s]+stop\b",                  # Ray's stop: every Ray process of the user
    r"\bpkill\b", r"\bkillall\b",             # by name
    r"\bkill\s+(-\S+\s+)*(--\s+)?-1\b",       # pid -1: every process the user may signal
    r"os\.kill\(\s*-1\b", r"killpg\(\s*0\b",  # the same from Python; the caller's own group
    r"\bfuser\s+(-\S+\s+)*-\w*k",             # every process using a file or port
)]
ALLOWED = {
    "tests/unit/test_no_broad_kill.py": "this guard's patterns and the stub of Ray's stop it checks is never called",
}
SCANNED = ("scripts", "recipes", "tests", "moe_lora_rl", ".ci")


def test_no_broad_kill_in_the_tree():
    found = []
    files = [p for d in SCANNED for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len(files) > 100
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if any(p.search(line) for p in BROAD_KILLS):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "broad kills (stop only what the run started, by pid or session):\n" + "\n".join(found)
    # control: each pattern finds the kill it is for
    for line in ('ray stop --force', '"$(dirname "$PY")/ray" stop', 'subprocess.run(["ray", "stop"])',
                 "pkill -f raylet", "killall python", "kill -9 -1", "kill -- -1", "os.kill(-1, 9)", "os.killpg(0, 9)",
                 "fuser -k 6379/tcp"):
        assert any(p.search(line) for p in BROAD_KILLS), line
    for line in ("kill -TERM \"$pid\"", "os.kill(pid, 9)", "kill -- -$run", "ray start --head", "ray.shutdown()"):
        assert not any(p.search(line) for p in BROAD_KILLS), line
