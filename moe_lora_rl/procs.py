"""Processes and ports on this host: liveness (the shared-memory transport, the engine's staging), a free port
(the engine's server, torchrun's rendezvous in the checks), and a command run under a time limit that ends, past it,
only the processes the command started (the recipes' runs: their own session, never every process of a name).

    python -m moe_lora_rl.procs --timeout-s 1500 -- CMD ARGS...    # CMD's status; 124 past the limit (as timeout's)
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

TIMED_OUT = 124                    # coreutils timeout's status for a command past its limit
INTERRUPTED = 130


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; another process may still take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (Linux: /proc), zombies left out. A session's id is the pid of the process
    that created it (setsid), and stays taken while any process of the session lives: a process started in its own
    session and everything it starts that does not call setsid itself (Ray's head, raylet, workers and their
    children, even once reparented) are the session's, and nothing else is."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            if os.getsid(pid) != sid:
                continue
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):        # gone meanwhile
            continue
        if state not in (b"Z", b"X"):
            out.append(pid)
    return out


def end_session(sid: int, grace_s: float = 5.0, rounds: int = 10) -> int:
    """SIGTERM every process of session `sid`, SIGKILL those left after grace_s, again until none is left (one
    started meanwhile is found by the next round). Returns how many processes were signalled; RuntimeError when
    some are still alive after `rounds` rounds."""
    signalled: set[int] = set()
    for r in range(rounds):
        pids = session_pids(sid)
        if not pids:
            return len(signalled)
        sig = signal.SIGTERM if r == 0 else signal.SIGKILL
        for pid in pids:
            try:
                os.kill(pid, sig)
                signalled.add(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if r == 0 else 1.0)
        while time.monotonic() < deadline and session_pids(sid):
            time.sleep(0.1)
    left = session_pids(sid)
    if left:
        raise RuntimeError(f"session {sid}: processes {left[:8]} still alive after {rounds} rounds of SIGKILL")
    return len(signalled)


def run_bounded(cmd: list[str], timeout_s: float, grace_s: float = 5.0) -> int:
    """Run cmd in a session of its own and return its exit status; past timeout_s (or on Ctrl-C / SIGTERM to this
    process) end every process of that session (end_session) and return 124 (130 when interrupted). Processes
    outside the session (another run's Ray, the user's) are never signalled."""
    proc = subprocess.Popen(cmd, start_new_session=True)

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = TIMED_OUT
        except KeyboardInterrupt:
            rc = INTERRUPTED
        # proc is not reaped yet: its pid, the session's id, cannot be reused while it is ended
        n = end_session(proc.pid, grace_s)
        proc.wait()
        why = f"past --timeout-s {timeout_s:g}" if rc == TIMED_OUT else "interrupted"
        print(f"procs: {' '.join(cmd[:2])} ... {why}: ended {n} processes of its session {proc.pid}", file=sys.stderr)
        return rc
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.procs", description=run_bounded.__doc__)
    ap.add_argument("--timeout-s", type=float, required=True)
    ap.add_argument("--grace-s", type=float, default=5.0, help="from SIGTERM to SIGKILL")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd or a.timeout_s <= 0:
        ap.error("give --timeout-s > 0 and a command after --")
    return run_bounded(cmd, a.timeout_s, a.grace_s)


if __name__ == "__main__":
    sys.exit(main())
