"""A sandbox in a Docker container, with the isolation flags that held every attack tried here.

Layout of one sandbox: a container whose main process is ``sleep infinity`` under ``--init`` as uid
65534, a tmpfs-backed size-limited named volume at /work (``put_archive``-proof and wiped on reset), a
size-limited tmpfs /tmp and /dev/shm, read-only root, no network, no capabilities, no-new-privileges,
memory (no swap) / CPU / pids limits. Commands run as uid 1000 through the executor (one ``docker
exec`` per sandbox, not per command), so a command that kills every process it can reach cannot kill
the container's keep-alive; the executor is non-dumpable, so no command can reach its stream (see
:mod:`agentrl.sandbox.executor`). Graders read files with the engine's archive API, not the executor.

Why not an executor under another uid: with ``--user 65534`` the engine gives no ``docker exec`` any
capability (not even a root one), so nothing in the container could start commands as uid 1000.
"""

from __future__ import annotations

import atexit
import io
import logging
import tarfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence

from agentrl.sandbox.base import SandboxError, SpecialFileError, work_path
from agentrl.sandbox.docker_client import docker_client
from agentrl.sandbox.engine_setup import DEFAULT_IMAGE
from agentrl.sandbox.executor_client import EXECUTOR_SOURCE, DockerAttachTransport, ExecutorClient
from agentrl.sandbox.executor_sandbox import AGENT_UID, BASE_ENV, ExecutorSandbox
from agentrl.sandbox.host_files import read_regular_file
from agentrl.sandbox.labels import sandbox_labels
from agentrl.sandbox.limits import SandboxLimits
from agentrl.sandbox.registry import track, untrack

log = logging.getLogger(__name__)

KEEPALIVE_USER = "65534:65534"
AGENT_USER = f"{AGENT_UID}:{AGENT_UID}"
# Go's os.FileMode type bits, as the engine reports them for an archived path.
_GO_MODE_DIR = 1 << 31
_GO_MODE_TYPE = _GO_MODE_DIR | 1 << 27 | 1 << 26 | 1 << 25 | 1 << 24 | 1 << 21 | 1 << 19
_TAR_OVERHEAD = 64 * 1024
_PROBE_FILE = ".agentrl-volume-probe"


class DockerSandbox(ExecutorSandbox):
    """One container. ``with DockerSandbox() as sb: sb.exec("ls", timeout=5)``.

    ``image`` must exist locally (it is never pulled) and provide ``python3`` and ``sleep``; build
    the default with ``agentrl sandbox setup`` (or ``--image NAME`` for another tag). ``read_only_mounts`` maps container paths to
    host paths bind-mounted read-only (the grader uses it for hidden tests). ``labels`` are added to
    the agentrl labels that ``agentrl sandbox gc`` uses.
    """

    def __init__(self, image: str = DEFAULT_IMAGE, *, limits: SandboxLimits | None = None,
                 labels: Mapping[str, str] | None = None, role: str = "sandbox",
                 read_only_mounts: Mapping[str, str] | None = None, client=None):
        super().__init__(limits)
        self.image = image
        self.name = f"agentrl-sb-{uuid.uuid4().hex[:12]}"
        self.volume_name = f"{self.name}-work"
        self.container_id: str | None = None
        self._create_sent = False  # a create whose answer was lost may still have made the container
        self.start_s: float | None = None  # how long start() took (container + executor)
        self._labels = sandbox_labels(role, dict(labels or {}))
        self._ro_mounts = dict(read_only_mounts or {})
        self._docker = client
        self._exec_socket = None
        self._work_on_host: str | None = None  # /work's volume as this host sees it, when it does

    @property
    def docker(self):
        if self._docker is None:
            self._docker = docker_client()
        return self._docker

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self.container_id is not None:
                return
            if self._closed:
                raise SandboxError("sandbox is closed")
            import docker
            from docker.types import Mount

            t0 = time.monotonic()
            api = self.docker.api
            try:
                api.inspect_image(self.image)
            except docker.errors.ImageNotFound as exc:
                raise SandboxError(f"image {self.image!r} is not on this engine (images are never pulled); "
                                   "run `agentrl sandbox setup` or pass an image you built") from exc
            lim = self.limits
            remove_deferred()
            track(self)
            try:
                api.create_volume(self.volume_name, driver="local", labels=self._labels, driver_opts={
                    "type": "tmpfs", "device": "tmpfs",
                    "o": f"nosuid,nodev,size={lim.work_bytes},uid={AGENT_UID},gid={AGENT_UID},mode=0755"})
                mounts = [Mount("/work", self.volume_name, type="volume")]
                mounts += [Mount(target, source, type="bind", read_only=True)
                           for target, source in self._ro_mounts.items()]
                host_config = api.create_host_config(
                    init=True, network_mode="none", read_only=True, cap_drop=["ALL"],
                    security_opt=["no-new-privileges"], mem_limit=lim.memory_bytes, shm_size=lim.tmp_bytes,
                    memswap_limit=lim.memory_bytes, nano_cpus=int(lim.cpus * 1e9), pids_limit=lim.pids,
                    tmpfs={"/tmp": f"rw,exec,nosuid,nodev,size={lim.tmp_bytes},mode=1777"}, mounts=mounts)
                self._create_sent = True
                created = api.create_container(
                    self.image, command=["sleep", "infinity"], user=KEEPALIVE_USER, working_dir="/work",
                    labels=self._labels, host_config=host_config, name=self.name, network_disabled=True,
                    environment=BASE_ENV)
                self.container_id = created["Id"]
                api.start(self.container_id)
                self._executor = self._launch_executor()
                self._executor.call({"op": "ping"}, 30.0)
                self._work_on_host = self._host_view_of_work()
            except Exception as exc:
                self._closed = True
                self._remove()
                if isinstance(exc, SandboxError):
                    raise
                raise SandboxError(f"could not start a sandbox from {self.image!r}: {exc}") from exc
            self.start_s = time.monotonic() - t0

    def close(self) -> None:
        with self._lock:
            if self._closed and self.container_id is None:
                return
            self._closed = True
            self._drop_executor()
            self._remove()

    def _remove(self) -> None:
        api = self.docker.api
        if self.container_id is not None or self._create_sent:
            # By name when the create's answer was lost (the engine went away mid-request).
            _remove_or_defer(api, "container", self.container_id or self.name)
            self.container_id = None
            self._create_sent = False
        _remove_or_defer(api, "volume", self.volume_name)
        untrack(self)
        remove_deferred()  # the engine answers again (or still does): what an outage left can go now

    # ---- executor hooks -----------------------------------------------------------------------
    def _launch_executor(self) -> ExecutorClient:
        api = self.docker.api
        created = api.exec_create(self.container_id, [self.python, "-c", EXECUTOR_SOURCE, "--contained"],
                                  stdin=True, stdout=True, stderr=True, user=AGENT_USER, workdir="/work",
                                  environment=BASE_ENV)
        sock_io = api.exec_start(created["Id"], socket=True)
        self._exec_socket = sock_io  # keep the SocketIO alive: it owns the hijacked connection
        return ExecutorClient(DockerAttachTransport(getattr(sock_io, "_sock", sock_io)))

    def _force_kill_processes(self) -> None:
        self._docker_exec_as_agent(["sh", "-c", "kill -9 -1"])  # a stopped executor dies too

    def _docker_exec_as_agent(self, argv: Sequence[str]) -> None:
        try:
            api = self.docker.api
            created = api.exec_create(self.container_id, list(argv), user=AGENT_USER)
            api.exec_start(created["Id"])
        except Exception as exc:
            log.warning("docker exec %s in %s failed: %s", argv, self.name, exc)

    def _host_view_of_work(self) -> str | None:
        """The work volume's directory on this host when it holds what the sandbox wrote (a local engine in
        this mount namespace), else None: a remote or rootless engine mounts it where this host cannot
        see it. Checked with a file written inside and read outside, then the work dir is emptied."""
        import secrets

        try:
            mountpoint = self.docker.api.inspect_volume(self.volume_name)["Mountpoint"]
        except Exception:
            return None
        token = secrets.token_hex(16)
        self.write_files({_PROBE_FILE: token})
        try:
            seen = read_regular_file(mountpoint, [_PROBE_FILE], max_bytes=64, path=_PROBE_FILE)
        except OSError:
            seen = None
        self.reset()
        return mountpoint if seen == token.encode() else None

    def export_file(self, path: str, *, max_bytes: int) -> bytes:
        """The file read from the work volume on the host without following links, or where the host does
        not see the volume, as the engine archives it (``get_archive``): the sandbox's processes take no
        part either way."""
        import docker
        import requests

        rel = work_path(self.workdir, path)
        full = f"{self.workdir}/{rel}"
        if self.container_id is None:
            raise SandboxError("sandbox is not running")
        if self._work_on_host is not None:
            # A stopped container's volume is unmounted: the file reads as missing, and the caller's
            # liveness check tells a dead sandbox from a missing file.
            return read_regular_file(self._work_on_host, rel.split("/"), max_bytes=max_bytes, path=path)
        try:
            chunks, st = self.docker.api.get_archive(self.container_id, full)
        except docker.errors.NotFound as exc:
            raise FileNotFoundError(f"{path} does not exist in the sandbox") from exc
        except (docker.errors.APIError, requests.exceptions.RequestException) as exc:  # or the engine is down
            raise SandboxError(f"could not archive {path}: {exc}") from exc
        mode, size = int(st.get("mode", 0)), int(st.get("size", 0))
        if mode & _GO_MODE_DIR:
            raise IsADirectoryError(f"{path} is a directory")
        if mode & _GO_MODE_TYPE:
            raise SpecialFileError(f"{path} is a link, FIFO, socket or device, not a regular file")
        if size > max_bytes:
            raise ValueError(f"{path} has {size} bytes, more than {max_bytes}")
        buf = bytearray()
        for chunk in chunks:  # bounded: the stat above is the engine's, the archive must agree with it
            buf += chunk
            if len(buf) > size + _TAR_OVERHEAD:
                raise SandboxError(f"archive of {path} is larger than its {size} bytes")
        with tarfile.open(fileobj=io.BytesIO(bytes(buf)), mode="r:") as tar:
            members = tar.getmembers()
            if len(members) != 1 or not members[0].isreg():
                raise SpecialFileError(f"{path} did not archive as one regular file")
            return tar.extractfile(members[0]).read()

    def _runtime_alive(self) -> bool:
        if self.container_id is None:
            return False
        try:
            return bool(self.docker.api.inspect_container(self.container_id)["State"]["Running"])
        except Exception:
            return False

    def __repr__(self) -> str:
        return f"DockerSandbox({self.name}, image={self.image!r})"


# Containers and volumes whose removal failed while the engine did not answer (a dockerd restart): the
# container survives a restart as a stopped one, and its owner (this process) is alive, so no orphan
# collection would take it before the run ends. Retried whenever a sandbox starts or is removed.
_deferred: dict[tuple[str, str], object] = {}  # (kind, id) -> the API client to remove it with
_deferred_lock = threading.Lock()


def _remove_or_defer(api, kind: str, ident: str) -> None:
    import docker

    try:
        (api.remove_container if kind == "container" else api.remove_volume)(ident, force=True)
    except docker.errors.NotFound:
        pass
    except Exception as exc:  # the engine is down or restarting: keep it for later
        log.debug("remove %s %s failed (%s); retried later", kind, ident[:24], exc)
        with _deferred_lock:
            _deferred[(kind, ident)] = api


def remove_deferred() -> int:
    """Retry the removals that failed while the engine was unreachable; returns how many remain."""
    with _deferred_lock:
        if not _deferred:
            return 0
        pending = dict(_deferred)
        _deferred.clear()
    for kind in ("container", "volume"):  # a volume goes once its container has
        for (k, ident), api in pending.items():
            if k == kind:
                _remove_or_defer(api, kind, ident)
    with _deferred_lock:
        return len(_deferred)


atexit.register(remove_deferred)
