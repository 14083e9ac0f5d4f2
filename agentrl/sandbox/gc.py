"""Remove sandboxes that their owner left behind (crash, SIGKILL, lost atexit), found by label."""

from __future__ import annotations

import logging
import time

from agentrl.sandbox import labels as L

log = logging.getLogger(__name__)



def _orphaned(item_labels: dict[str, str], older_than_s: float, only_dead_owners: bool) -> bool:
    try:
        age = time.time() - float(item_labels.get(L.CREATED, "0"))
    except ValueError:
        age = float("inf")
    if age < older_than_s:
        return False
    return not (only_dead_owners and L.owner_alive(item_labels))


def collect_garbage(*, older_than_s: float = 0.0, only_dead_owners: bool = True) -> dict[str, int]:
    """Remove agentrl containers + volumes (and bubblewrap work dirs) whose owner process is gone
    (or all of them with ``only_dead_owners=False``) and that are older than ``older_than_s``."""
    removed = {"containers": 0, "volumes": 0, "dirs": 0}
    from agentrl.sandbox.docker_client import docker_reachable

    if docker_reachable():
        from agentrl.sandbox.docker_client import docker_client

        api = docker_client().api
        for c in api.containers(all=True, filters={"label": L.SANDBOX}):
            if _orphaned(c.get("Labels") or {}, older_than_s, only_dead_owners):
                try:
                    api.remove_container(c["Id"], force=True)
                    removed["containers"] += 1
                except Exception as exc:
                    log.warning("could not remove container %s: %s", c["Id"][:12], exc)
        for v in api.volumes(filters={"label": L.SANDBOX}).get("Volumes") or []:
            if _orphaned(v.get("Labels") or {}, older_than_s, only_dead_owners):
                try:
                    api.remove_volume(v["Name"], force=True)
                    removed["volumes"] += 1
                except Exception as exc:  # still mounted by a live container
                    log.warning("could not remove volume %s: %s", v["Name"], exc)
    from agentrl.sandbox.bwrap_sandbox import BWRAP_ROOT, read_owner_labels, remove_bwrap_dir

    if BWRAP_ROOT.is_dir():
        for d in BWRAP_ROOT.iterdir():
            if d.is_dir() and _orphaned(read_owner_labels(d), older_than_s, only_dead_owners):
                remove_bwrap_dir(d)
                removed["dirs"] += 1
    return removed

