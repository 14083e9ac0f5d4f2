"""Make a Docker engine and the base image ``agentrl-sandbox:py3`` exist on this machine, idempotently.

Each step checks first and does nothing when its result is already there, so ``agentrl sandbox setup``
is cheap to run before every test session. No registry is reachable from these machines, so the image
is built offline: ``debootstrap`` a minimal Debian with python3 from the mirror apt already uses, then
``docker import`` the tree (no registry is reachable, so the base image is built, not pulled).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "agentrl-sandbox:py3"
DEFAULT_SUITE = "bookworm"
FALLBACK_MIRROR = "http://deb.debian.org/debian"
DOCKER_SOCKET = Path("/var/run/docker.sock")
DOCKERD_LOG = Path("/var/log/agentrl-dockerd.log")
# Packages the setup installs when their binary is missing: (binary, apt package).
_APT_NEEDS = (("dockerd", "docker.io"), ("debootstrap", "debootstrap"), ("bwrap", "bubblewrap"))


class SetupError(RuntimeError):
    """A setup step failed; the message says which and how to fix it."""


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    log.info("$ %s", " ".join(cmd))
    return subprocess.run(cmd, check=True, **kwargs)


def _have(binary: str) -> bool:
    return shutil.which(binary) is not None or Path("/usr/sbin", binary).exists()


def install_packages() -> list[str]:
    """apt-get install docker.io, debootstrap and bubblewrap where missing; returns what was installed."""
    missing = [pkg for binary, pkg in _APT_NEEDS if not _have(binary)]
    if not missing:
        return []
    if os.geteuid() != 0:
        raise SetupError(f"need root to apt-get install {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _run(["apt-get", "update", "-q"], env=env)
    _run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env)
    return missing


def engine_reachable(timeout: float = 3.0) -> bool:
    """True when a Docker engine answers ``ping`` on the default socket (or $DOCKER_HOST)."""
    try:
        import docker

        client = docker.from_env(timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def start_dockerd(wait_s: float = 60.0) -> bool:
    """Start dockerd detached when no engine answers; returns True when this call started it."""
    if engine_reachable():
        return False
    if os.geteuid() != 0:
        raise SetupError("no Docker engine is reachable and starting dockerd needs root")
    dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
    # A stale pid file from a dead daemon makes dockerd refuse to start.
    pid_file = Path("/var/run/docker.pid")
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text().strip()), 0)
        except (ValueError, ProcessLookupError):
            pid_file.unlink(missing_ok=True)
    DOCKERD_LOG.parent.mkdir(parents=True, exist_ok=True)
    # setsid -f: the daemon must outlive this process and the CI step that ran it.
    subprocess.run(
        ["setsid", "-f", "sh", "-c", f'exec "{dockerd}" >>"{DOCKERD_LOG}" 2>&1 </dev/null'], check=True
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if engine_reachable(timeout=2.0):
            log.info("dockerd is up (log: %s)", DOCKERD_LOG)
            return True
        time.sleep(0.5)
    tail = DOCKERD_LOG.read_text(errors="replace")[-2000:] if DOCKERD_LOG.exists() else ""
    raise SetupError(f"dockerd did not answer within {wait_s:.0f}s; last log lines:\n{tail}")


def apt_mirror(etc_apt: Path = Path("/etc/apt")) -> str:
    """The Debian mirror apt already uses (deb822 ``*.sources`` first, then ``sources.list``)."""
    sources_d = etc_apt / "sources.list.d"
    candidates = [sources_d / "debian.sources", *sorted(sources_d.glob("*.sources"))]
    for path in candidates:
        if path.is_file():
            for stanza in path.read_text().split("\n\n"):
                uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
                if uris and "/debian" in uris.group(1) and "security" not in uris.group(1):
                    return uris.group(1).rstrip("/")
    for path in [etc_apt / "sources.list", *sorted(sources_d.glob("*.list"))]:
        if path.is_file():
            for line in path.read_text().splitlines():
                m = re.match(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+/debian)/?\s", line)
                if m and "security" not in m.group(1):
                    return m.group(1)
    return FALLBACK_MIRROR


def image_exists(image: str = DEFAULT_IMAGE) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0


def docker_problem(image: str = DEFAULT_IMAGE) -> str | None:
    """Why Docker sandboxes cannot run here (no engine, image missing), or None when they can."""
    from agentrl.sandbox.docker_client import docker_client, docker_reachable

    if not docker_reachable():
        return "no Docker engine reachable (run `bash scripts/docker_setup` or `agentrl sandbox setup`)"
    try:
        docker_client().api.inspect_image(image)
    except Exception:
        return f"image {image} missing (run `agentrl sandbox setup`)"
    return None


def build_image(image: str = DEFAULT_IMAGE, *, suite: str = DEFAULT_SUITE, mirror: str | None = None,
                force: bool = False) -> bool:
    """Build the base image offline with debootstrap + ``docker import``; returns True when it built."""
    if not force and image_exists(image):
        return False
    if os.geteuid() != 0:
        raise SetupError("debootstrap needs root")
    mirror = mirror or apt_mirror()
    with tempfile.TemporaryDirectory(prefix="agentrl-rootfs-") as tmp:
        rootfs = Path(tmp, "rootfs")
        _run(["debootstrap", "--variant=minbase", "--include=python3", suite, str(rootfs), mirror],
             stdout=subprocess.DEVNULL)
        # The image only ever runs offline with a read-only root: drop apt caches and docs.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            _run(["docker", "import", "--change", 'CMD ["/bin/sh"]', "-", image], stdin=tar.stdout,
                 stdout=subprocess.DEVNULL)
        finally:
            tar.stdout.close()
            if tar.wait() != 0:
                raise SetupError("tar of the debootstrap tree failed")
    return True


def setup(image: str = DEFAULT_IMAGE, *, build: bool = True) -> dict[str, object]:
    """Run every step; returns what each did (for the CLI's summary)."""
    installed = install_packages()
    started = start_dockerd()
    built = build_image(image) if build else False
    return {"installed": installed, "started_dockerd": started, "built_image": built, "image": image}
