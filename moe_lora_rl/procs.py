"""Processes and ports on this host: liveness (the shared-memory transport, the engine's staging) and a free port
(the engine's server, torchrun's rendezvous in the checks)."""
from __future__ import annotations

import os
import socket


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
