"""DockerSandbox and SandboxPool on a real engine: isolation flags, files, exec API, async, pool
recycling and health checks, cleanup (close, atexit, gc by label), setup idempotency."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import pytest

from agentrl.sandbox import DockerSandbox, ExecResult, SandboxError, SandboxLimits, SandboxPool
from agentrl.sandbox import labels as L

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


def _api():
    from agentrl.sandbox.docker_client import docker_client

    return docker_client().api


def _exists(kind: str, name: str) -> bool:
    import docker

    try:
        (_api().inspect_container if kind == "container" else _api().inspect_volume)(name)
        return True
    except docker.errors.NotFound:
        return False


@pytest.fixture(scope="module")
def sb():
    with DockerSandbox(limits=SandboxLimits(output_limit=1000)) as sandbox:
        yield sandbox


def test_container_carries_every_isolation_flag(sb):
    info = _api().inspect_container(sb.container_id)
    hc = info["HostConfig"]
    assert hc["NetworkMode"] == "none" and hc["ReadonlyRootfs"] is True and hc["Init"] is True
    assert hc["CapDrop"] == ["ALL"] and "no-new-privileges" in hc["SecurityOpt"]
    assert hc["Memory"] == 512 * 2**20 and hc["MemorySwap"] == 512 * 2**20
    assert hc["NanoCpus"] == 10**9 and hc["PidsLimit"] == 64
    assert info["Config"]["User"] == "65534:65534"
    assert info["Config"]["Labels"][L.SANDBOX] == "1"
    assert info["Config"]["Labels"][L.OWNER_PID] == str(os.getpid())
    work = [m for m in info["Mounts"] if m["Destination"] == "/work"]
    assert work and work[0]["Type"] == "volume" and work[0]["Name"] == sb.volume_name
    vol = _api().inspect_volume(sb.volume_name)
    assert vol["Options"]["type"] == "tmpfs" and "size=67108864" in vol["Options"]["o"]
    assert vol["Labels"][L.SANDBOX] == "1"


def test_exec_shell_argv_stdin_env(sb):
    r = sb.exec("echo $FOO; cat", timeout=10, stdin="piped", env={"FOO": "bar"})
    assert isinstance(r, ExecResult) and r.ok
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.oom_killed, r.truncated) == (0, "bar\npiped", "", False,
                                                                                          False, False)
    r = sb.exec(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "$HOME"], timeout=10)
    assert r.stdout == "['a b', '$HOME']\n"
    assert sb.exec("exit 7", timeout=10).exit_code == 7
    assert sb.exec(["no-such-binary"], timeout=10).exit_code == 127


def test_run_python_and_configurable_output_cap(sb):
    r = sb.run_python("print('x' * 5000)", timeout=10)
    assert r.truncated and r.stdout == "x" * 1000
    big = "y = 1\n" * 20000 + "print(y)\n"  # > 96 KiB: goes through a file, not argv
    assert sb.run_python(big, timeout=20).stdout == "1\n"


def test_files_roundtrip_binary_nested_and_errors(sb):
    blob = bytes(range(256)) * 10
    sb.write_files({"d/e/blob.bin": blob, "/work/t.txt": "héllo"})
    assert sb.read_file("d/e/blob.bin") == blob
    assert sb.read_file("t.txt") == "héllo".encode()
    assert sb.read_file("d/e/blob.bin", max_bytes=10) == blob[:10]
    assert sb.exec("stat -c '%u %a' d/e/blob.bin", timeout=10).stdout == "1000 644\n"
    big = os.urandom(8 * 2**20)
    sb.write_files({"big.bin": big})
    assert sb.read_file("big.bin") == big
    assert sb.exec("rm big.bin", timeout=10).exit_code == 0
    with pytest.raises(FileNotFoundError):
        sb.read_file("missing.txt")
    with pytest.raises(IsADirectoryError):
        sb.read_file("d")
    for bad in ["../etc/passwd", "/etc/passwd", ""]:
        with pytest.raises(ValueError):
            sb.write_files({bad: "x"})
        with pytest.raises(ValueError):
            sb.read_file(bad)
    with pytest.raises(ValueError):
        sb.exec("true", timeout=0)


def test_missing_image_is_a_clear_error():
    with pytest.raises(SandboxError, match="never pulled"), DockerSandbox("agentrl-no-such-image:1"):
        pass


def test_close_removes_container_and_volume():
    sandbox = DockerSandbox()
    sandbox.start()
    cid, vol = sandbox.container_id, sandbox.volume_name
    assert _exists("container", cid) and _exists("volume", vol)
    sandbox.close()
    sandbox.close()  # twice is fine
    assert not _exists("container", cid) and not _exists("volume", vol)
    with pytest.raises(SandboxError, match="closed"):  # using a closed sandbox is a caller bug
        sandbox.exec("true", timeout=5)


def test_container_killed_from_outside_gives_a_result_not_an_exception():
    with DockerSandbox() as sandbox:
        _api().kill(sandbox.container_id)
        r = sandbox.exec("echo hi", timeout=5)
        assert r.exit_code == -1 and "no longer running" in r.stderr
        assert not sandbox.alive and not sandbox.healthy()


def test_async_counterparts():
    async def main():
        async with DockerSandbox() as sandbox:
            await sandbox.awrite_files({"a.txt": "A"})
            results = await asyncio.gather(*[sandbox.aexec(f"cat a.txt; echo {i}", timeout=10) for i in range(4)])
            code = await sandbox.arun_python("print(2 + 2)", timeout=10)
            return [r.stdout for r in results], code.stdout, await sandbox.aread_file("a.txt")

    outs, code, data = asyncio.run(main())
    assert sorted(outs) == [f"A{i}\n" for i in range(4)] and code == "4\n" and data == b"A"


def test_pool_recycles_by_reset_and_replaces_dead_or_worn_sandboxes():
    with SandboxPool(size=1, backend="docker", max_uses=3) as pool:
        with pool.session() as first:
            first.write_files({"secret.txt": "episode 1"})
            first_id = first.container_id
        with pool.session() as second:
            assert second.container_id == first_id  # reset, not replaced
            assert second.exec("ls -A /work /tmp", timeout=10).stdout.split() == ["/tmp:", "/work:"]
            _api().kill(second.container_id)  # dies mid-episode
        with pool.session() as third:
            assert third.container_id != first_id and third.healthy()
            third_id = third.container_id
        for _ in range(3):
            with pool.session() as sb:
                pass
        assert sb.container_id != third_id  # replaced after max_uses episodes
        assert pool.stats.replaced >= 2
    assert not _exists("container", third_id)


def test_pool_bounds_concurrency_and_replace_policy():
    with SandboxPool(size=1, backend="docker", recycle="replace") as pool:
        sb = pool.acquire()
        with pytest.raises(TimeoutError):
            pool.acquire(timeout=0.5)
        old = sb.container_id
        pool.release(sb)
        with pool.session(timeout=30) as again:
            assert again.container_id != old
        with pytest.raises(ValueError, match="does not belong"):
            pool.release(DockerSandbox())


def test_pool_async_sessions_never_exceed_size():
    in_use, peak = 0, 0

    async def episode(pool, i):
        nonlocal in_use, peak
        async with pool.asession() as sb:
            in_use += 1
            peak = max(peak, in_use)
            r = await sb.arun_python(f"print({i})", timeout=10)
            in_use -= 1
            return r.stdout

    async def main():
        async with SandboxPool(size=2, backend="docker") as pool:
            return await asyncio.gather(*[episode(pool, i) for i in range(8)])

    assert sorted(asyncio.run(main())) == sorted(f"{i}\n" for i in range(8))
    assert peak <= 2


def test_atexit_removes_sandboxes_a_program_forgot():
    code = ("from agentrl.sandbox import DockerSandbox\n"
            "sb = DockerSandbox(); sb.start(); print(sb.container_id, sb.volume_name, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cid, vol = out.stdout.split()
    assert not _exists("container", cid) and not _exists("volume", vol)


def test_gc_removes_orphans_by_label_and_keeps_live_ones(capsys):
    from agentrl.sandbox.cli import main

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    orphan = DockerSandbox(labels={L.OWNER_PID: dead})  # looks like a crashed trainer's sandbox
    orphan.start()
    with DockerSandbox() as live:
        assert main(["gc"]) == 0
        out = capsys.readouterr().out  # other dead processes' orphans may be removed too
        assert re.match(r"removed [1-9]\d* containers, [1-9]\d* volumes", out), out
        assert not _exists("container", orphan.container_id) and not _exists("volume", orphan.volume_name)
        assert live.exec("echo alive", timeout=10).stdout == "alive\n"
    orphan.close()  # already gone: no error


def test_setup_is_idempotent_when_everything_exists(capsys):
    from agentrl.sandbox.cli import main

    t0 = time.monotonic()
    assert main(["setup"]) == 0
    out = capsys.readouterr().out
    assert "image agentrl-sandbox:py3: present" in out and "already running" in out
    assert time.monotonic() - t0 < 30


def test_start_cost_is_recorded(sb):
    assert sb.start_s is not None and 0 < sb.start_s < 60
