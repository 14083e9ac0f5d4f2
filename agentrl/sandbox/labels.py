"""Labels on every container/volume agentrl creates, so ``agentrl sandbox gc`` can find orphans."""

from __future__ import annotations

import os
import socket
import time

SANDBOX = "agentrl.sandbox"
OWNER_PID = "agentrl.owner_pid"
OWNER_HOST = "agentrl.owner_host"
CREATED = "agentrl.created"
ROLE = "agentrl.role"


def sandbox_labels(role: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    labels = {SANDBOX: "1", OWNER_PID: str(os.getpid()), OWNER_HOST: socket.gethostname(),
              CREATED: f"{time.time():.3f}", ROLE: role}
    labels.update(extra or {})
    return labels


def owner_alive(labels: dict[str, str]) -> bool:
    """True when the labels name a process on this host that still exists."""
    if labels.get(OWNER_HOST) != socket.gethostname():
        return False
    try:
        os.kill(int(labels.get(OWNER_PID, "0")), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return int(labels.get(OWNER_PID, "0")) > 0
