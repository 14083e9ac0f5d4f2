"""The attacks of issue 21, each asserting that it fails and that the pool then serves the next episode
correctly: forging the executor's replies, oversized frames, a stopped executor answered for by a
leftover, a health check faked by a leftover, FIFOs and links as graded files, and (bubblewrap) host
root, host files reachable through /proc/1/fd, a writable /dev, nested user namespaces."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest

from agentrl.sandbox import Grader

pytestmark = pytest.mark.timeout(180)

TESTS = {"test_hidden.py": "import solution\n\ndef test_answer():\n    assert solution.answer() == 42\n"}
# Writes a forged reply (and a 4 GiB length header) into every fd of every other process it can open,
# the way a hostile run_python would hijack the executor's response pipe.
FORGE = (
    "import json, os, struct\n"
    "fake = json.dumps({'exit_code': 0, 'stdout': 'Rk9SR0VE', 'stderr': '', 'stdout_total': 6,\n"
    "                   'stderr_total': 0, 'timed_out': False, 'oom_killed': False, 'duration_s': 0,\n"
    "                   'ok': True, 'pid': 1}).encode()\n"
    "frame = (struct.pack('>I', len(fake)) + fake) * 4 + struct.pack('>I', 2**32 - 1) + b'x' * 2**20\n"
    "opened = 0\n"
    "for p in os.listdir('/proc'):\n"
    "    if not p.isdigit() or int(p) == os.getpid():\n"
    "        continue\n"
    "    try:\n"
    "        fds = os.listdir(f'/proc/{p}/fd')\n"
    "    except OSError:\n"
    "        continue\n"
    "    for fd in fds:\n"
    "        try:\n"
    "            w = os.open(f'/proc/{p}/fd/{fd}', os.O_WRONLY | os.O_NONBLOCK)\n"
    "        except OSError:\n"
    "            continue\n"
    "        opened += 1\n"
    "        try:\n"
    "            os.write(w, frame)\n"
    "        except OSError:\n"
    "            pass\n"
    "print('opened', opened)\n"
)


@pytest.fixture
def pool(backend, pools):
    return pools(backend)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def assert_next_episode_served(pool) -> None:
    t0 = time.monotonic()
    with pool.session(timeout=60) as sb:
        r = sb.exec("echo ok; ls -A /work /tmp", timeout=20)
        assert r.exit_code == 0 and r.stdout.split() == ["ok", "/tmp:", "/work:"], r
        assert sb.run_python("print(6 * 7)", timeout=20).stdout == "42\n"
    assert time.monotonic() - t0 < 15


def test_commands_cannot_reach_or_forge_the_executor_stream(pool):
    before = rss_mib()
    with pool.session() as sb:
        r = sb.run_python(FORGE, timeout=30)
        assert r.exit_code == 0 and r.stdout == "opened 0\n", r
        # a leftover that keeps trying while the next commands run
        sb.exec(["sh", "-c", "setsid python3 -c \"$0\" >/dev/null 2>&1 &", "import time\nwhile True:\n"
                 "    exec(" + repr(FORGE) + ")\n    time.sleep(0.01)\n"], timeout=20)
        for i in range(5):
            assert sb.exec(f"echo real {i}", timeout=20).stdout == f"real {i}\n"
        assert sb.healthy()
    assert rss_mib() - before < 64  # the 4 GiB header never became an allocation
    assert_next_episode_served(pool)


def test_a_stopped_executor_is_replaced_not_impersonated(pool):
    with pool.session() as sb:
        # A leftover that stops every process of the agent's uid, the executor included where it can be
        # (in Docker; under bubblewrap the executor is PID 1 and the stop is ignored).
        sb.exec("setsid sh -c 'sleep 0.3; kill -STOP -1' >/dev/null 2>&1 &", timeout=20)
        time.sleep(0.6)
        r = sb.exec("echo after", timeout=2)
        assert r.stdout in ("after\n", ""), r
        assert "FORGED" not in r.stdout
    assert_next_episode_served(pool)


def test_health_check_fails_when_the_work_dir_is_unusable(pool):
    with pool.session() as sb:
        sb.exec("chmod 000 /work", timeout=20)
        assert not sb.healthy()
        sb.reset()
        assert sb.healthy()
    assert_next_episode_served(pool)


@pytest.mark.parametrize("trap", ["mkfifo solution.py", "echo 'def answer(): return 42' > real.py && "
                                  "ln -s /work/real.py solution.py", "ln -s /etc/passwd solution.py",
                                  "mkdir solution.py"])
def test_a_fifo_or_link_named_like_the_graded_file_fails_at_once(pool, backend, trap):
    grader = Grader(backend=backend, timeout=20)
    with pool.session() as sb:
        assert sb.exec(trap, timeout=20).exit_code == 0
        t0 = time.monotonic()
        v = grader.grade_from(sb, ["solution.py"], TESTS)
        assert not v.passed and v.reason == "solution file solution.py is not a regular file", v
        assert time.monotonic() - t0 < 5
    assert_next_episode_served(pool)


@pytest.mark.docker
@pytest.mark.parametrize("trap", ["mkfifo solution.py", "ln -s /etc/passwd solution.py", "mkdir solution.py"])
def test_the_archive_path_of_a_remote_engine_refuses_the_same_traps(pools, trap):
    """Where the host cannot see the work volume (a remote or rootless engine), docker sandboxes export
    through the engine's archive API instead: same answers, a regular file read, a trap refused."""
    pool = pools("docker")
    grader = Grader(backend="docker", timeout=20)
    with pool.session() as sb:
        on_host, sb._work_on_host = sb._work_on_host, None
        try:
            sb.write_files({"solution.py": "def answer():\n    return 42\n"})
            assert grader.grade_from(sb, ["solution.py"], TESTS).passed
            assert sb.exec(f"rm -r solution.py && {trap}", timeout=20).exit_code == 0
            v = grader.grade_from(sb, ["solution.py"], TESTS)
            assert not v.passed and v.reason == "solution file solution.py is not a regular file", v
        finally:
            sb._work_on_host = on_host
    assert_next_episode_served(pool)


@pytest.mark.docker
def test_a_killed_container_reads_as_missing_and_as_dead_never_as_a_solution(pools):
    from agentrl.sandbox.docker_client import docker_client

    pool = pools("docker")
    grader = Grader(backend="docker", timeout=20)
    with pool.session() as sb:
        assert sb._work_on_host is not None  # this machine's engine is local: the host reads the volume
        sb.write_files({"solution.py": "def answer():\n    return 42\n"})
        docker_client().api.kill(sb.container_id)
        v = grader.grade_from(sb, ["solution.py"], TESTS)
        assert not v.passed and "missing" in v.reason and not sb.alive
    assert_next_episode_served(pool)


def test_grading_reads_the_file_even_when_the_executor_is_gone(pool, backend):
    grader = Grader(backend=backend, timeout=20)
    with pool.session() as sb:
        sb.write_files({"solution.py": "def answer():\n    return 42\n"})
        sb.exec("kill -STOP -1; kill -9 -1", timeout=5)
        assert grader.grade_from(sb, ["solution.py"], TESTS).passed
    assert_next_episode_served(pool)


# ---- bubblewrap's own holes ----------------------------------------------------------------------
@pytest.fixture
def bwrap_pool(pools, require_bwrap):
    return pools("bwrap")


def test_bwrap_sandbox_uid_is_not_host_root(bwrap_pool):
    with bwrap_pool.session() as sb:
        pid = sb._child_pid
        outer = Path(f"/proc/{pid}/uid_map").read_text().split()
        assert outer[0] == "1000" and outer[1] != "0", outer
        uids = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:")]
        assert "0" not in uids[0].split()[1:], uids
    assert_next_episode_served(bwrap_pool)


def test_bwrap_no_host_file_through_proc_1_fd(bwrap_pool):
    with bwrap_pool.session() as sb:
        r = sb.exec("for f in /proc/1/fd/*; do echo x >> $f && echo WROTE $f; done; ls /proc/1/fd", timeout=20)
        assert "WROTE" not in r.stdout and "Permission denied" in r.stderr, r
        r = sb.run_python(FORGE, timeout=30)
        assert r.stdout == "opened 0\n", r
    assert_next_episode_served(bwrap_pool)


def test_bwrap_dev_is_minimal_and_read_only(bwrap_pool):
    with bwrap_pool.session() as sb:
        r = sb.exec("ls /dev; touch /dev/x 2>&1; df -k /dev/shm | tail -1", timeout=20)
        names = set(r.stdout.split("\n")[0:20])
        assert {"null", "zero", "urandom"} <= names and "Read-only file system" in r.stdout, r
        assert int(r.stdout.strip().splitlines()[-1].split()[1]) <= 16 * 1024, r
    assert_next_episode_served(bwrap_pool)


def test_bwrap_seccomp_blocks_nested_user_namespaces_and_the_keyring(bwrap_pool):
    with bwrap_pool.session() as sb:
        r = sb.exec("grep Seccomp: /proc/self/status; unshare -r id || echo denied", timeout=20)
        assert r.stdout.split() == ["Seccomp:", "2", "denied"], r
        code = ("import ctypes, os\nc = ctypes.CDLL(None, use_errno=True)\n"
                "print(c.syscall(248, b'user', b'k', b'v', 1, -4), ctypes.get_errno())\n")  # add_key
        assert sb.run_python(code, timeout=20).stdout == "-1 1\n"
    assert_next_episode_served(bwrap_pool)


def test_bwrap_without_seccomp_is_off_by_default(monkeypatch, require_bwrap):
    from agentrl.sandbox import BwrapSandbox, SandboxError, backend, bwrap_sandbox, docker_client

    monkeypatch.setattr(bwrap_sandbox, "seccomp_problem", lambda: "libseccomp not found")
    with pytest.raises(SandboxError, match="no seccomp filter"):
        BwrapSandbox().start()
    import agentrl.sandbox.seccomp as sc

    monkeypatch.setattr(sc, "seccomp_problem", lambda: "libseccomp not found")
    monkeypatch.setattr(docker_client, "docker_reachable", lambda: False)
    with pytest.raises(SandboxError, match="fallback is off"):
        backend.resolve_backend("auto")
