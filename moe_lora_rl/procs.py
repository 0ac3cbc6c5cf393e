"""Process liveness on this host (pure: used by the shared-memory transport and the engine's staging)."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
