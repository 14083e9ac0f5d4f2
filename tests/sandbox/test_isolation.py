"""Reset isolates episodes, one test per channel, on Docker and bubblewrap: what one episode leaves in a
pool of one sandbox (so the next episode gets the same one) is gone for the next, and the next episode
is served correctly and fast."""

from __future__ import annotations

import time

import pytest

from agentrl.sandbox.executor_sandbox import WRITABLE_DIRS

pytestmark = pytest.mark.timeout(180)

_solo: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _close_solo_pools():
    yield
    for pool in _solo.values():
        pool.close()
    _solo.clear()


@pytest.fixture
def solo(backend):
    """A pool of ONE sandbox: every episode runs in the same sandbox after the previous one's reset."""
    from agentrl.sandbox import SandboxPool

    if backend not in _solo:
        _solo[backend] = SandboxPool(size=1, backend=backend).start()
    return _solo[backend]


def two_episodes(pool, plant: str, probe: str, *, python: bool = True):
    """Run ``plant`` in one episode and ``probe`` in the next; returns (planted, probed) results and
    checks the second episode ran in the same sandbox, served fast."""
    run = (lambda sb, code: sb.run_python(code, timeout=20)) if python else (lambda sb, cmd: sb.exec(cmd, timeout=20))
    with pool.session(timeout=60) as sb:
        first = id(sb)
        planted = run(sb, plant)
    t0 = time.monotonic()
    with pool.session(timeout=60) as sb:
        assert id(sb) == first, "a pool of one must hand out the same sandbox"
        probed = run(sb, probe)
        ok = sb.exec("echo ok > /work/f && cat /work/f", timeout=20)
    assert ok.stdout == "ok\n", ok
    assert time.monotonic() - t0 < 10
    return planted, probed


def test_every_writable_place_is_known_and_emptied(solo):
    find_writable = (
        "import os\n"
        "found = []\n"
        "for top, dirs, _ in os.walk('/'):\n"
        "    if top.startswith(('/proc', '/sys')):\n"
        "        dirs[:] = []\n"
        "        continue\n"
        "    try:\n"
        "        os.close(os.open(top + '/.w', os.O_CREAT | os.O_EXCL | os.O_WRONLY))\n"
        "        os.unlink(top + '/.w')\n"
        "        found.append(top)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(sorted(found))\n"
    )
    with solo.session() as sb:
        writable = eval(sb.run_python(find_writable, timeout=60).stdout)  # noqa: S307 - our own repr
    assert set(writable) <= {"/work", *WRITABLE_DIRS}, writable
    plant = (f"for d in {writable!r}:\n    open(d + '/left.txt', 'w').write('secret')\n"
             "import os\nos.makedirs('/work/a/b/c')\nopen('/work/a/b/c/deep', 'w').write('secret')\n")
    probe = f"import os\nprint(sorted((d, sorted(os.listdir(d))) for d in {writable!r}))\n"
    planted, probed = two_episodes(solo, plant, probe)
    assert planted.exit_code == 0, planted
    assert probed.stdout == repr(sorted((d, []) for d in writable)) + "\n", probed


def test_posix_shm_and_mqueue(solo):
    plant = ("open('/dev/shm/sem.x', 'w').write('1')\nopen('/dev/shm/segment', 'w').write('secret')\n"
             "import ctypes, os\nrt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
             "rt.mq_open.restype = ctypes.c_int\n"
             "q = rt.mq_open(b'/leak', os.O_CREAT | os.O_RDWR, 0o600, None)\n"
             "assert q >= 0, ctypes.get_errno()\n"
             "assert rt.mq_send(q, b'secret', 6, 0) == 0\nprint(sorted(os.listdir('/dev/mqueue')))\n")
    probe = ("import ctypes, os\nrt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
             "print(os.listdir('/dev/shm'), os.listdir('/dev/mqueue'), rt.mq_open(b'/leak', os.O_RDWR, 0, None))\n")
    planted, probed = two_episodes(solo, plant, probe)
    assert planted.stdout == "['leak']\n", planted
    assert probed.stdout == "[] [] -1\n", probed


def test_sysv_shared_memory_message_queues_and_semaphores(solo):
    plant = ("import ctypes\nc = ctypes.CDLL(None, use_errno=True)\n"
             "assert c.shmget(0x1234, 4096, 0o1600) >= 0\nassert c.msgget(0x1235, 0o1600) >= 0\n"
             "assert c.semget(0x1236, 1, 0o1600) >= 0\n"
             "print([len(open(f'/proc/sysvipc/{k}').readlines()) - 1 for k in ('shm', 'msg', 'sem')])\n")
    probe = ("import ctypes\nc = ctypes.CDLL(None)\n"
             "print([len(open(f'/proc/sysvipc/{k}').readlines()) - 1 for k in ('shm', 'msg', 'sem')],\n"
             "      c.shmget(0x1234, 0, 0), c.msgget(0x1235, 0), c.semget(0x1236, 0, 0))\n")
    planted, probed = two_episodes(solo, plant, probe)
    assert planted.stdout == "[1, 1, 1]\n", planted
    assert probed.stdout == "[0, 0, 0] -1 -1 -1\n", probed


def test_permissions_the_previous_episode_locked(solo):
    plant = ("mkdir -p shut/inner ro && echo s > shut/inner/f && echo s > ro/f && chmod 000 shut/inner shut "
             "&& chmod 555 ro && mkdir /tmp/t && echo s > /tmp/t/f && chmod 000 /tmp/t && chmod 000 /work && echo planted")
    probe = "ls -A /work /tmp && stat -c %a /work && touch /work/new && echo writable"
    planted, probed = two_episodes(solo, plant, probe, python=False)
    assert planted.stdout == "planted\n", planted
    assert probed.exit_code == 0 and probed.stdout.split() == ["/tmp:", "/work:", "755", "writable"], probed


def test_leftover_processes_of_every_kind(solo):
    plant = ("setsid sh -c 'trap \"\" TERM HUP; sleep 301' >/dev/null 2>&1 & "
             "sh -c 'kill -STOP $$; sleep 302' & "
             "nohup sleep 303 >/dev/null 2>&1 & echo planted")
    probe = ("import os\nleft = []\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        try:\n"
             "            cmd = open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ').decode()\n"
             "        except OSError:\n            continue\n"
             "        if any(n in cmd for n in ('301', '302', '303', '304')):\n            left.append(cmd)\n"
             "print(left)\n")
    with solo.session() as sb:
        assert sb.exec(plant, timeout=20).stdout == "planted\n"
        sb.exec("setsid sleep 304 &", timeout=20)
    with solo.session() as sb:
        assert sb.run_python(probe, timeout=20).stdout == "[]\n"
