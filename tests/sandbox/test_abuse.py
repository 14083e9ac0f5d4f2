"""Escape / abuse suite, run against Docker and bubblewrap: every attack is contained, and the pool
still serves a clean, working sandbox for the next episode afterwards."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.timeout(180)

LIST_PROCS = (
    "import os\n"
    "for p in os.listdir('/proc'):\n"
    "    if p.isdigit():\n"
    "        try:\n"
    "            print(open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ').decode().replace('\\n', ' ').strip())\n"
    "        except OSError:\n"
    "            pass\n"
)


@pytest.fixture
def pool(backend, pools):
    return pools(backend)


def procs(sb) -> list[str]:
    r = sb.run_python(LIST_PROCS, timeout=20)
    assert r.exit_code == 0, r
    return r.stdout.splitlines()


def assert_pool_serves(pool) -> None:
    """The next episode gets a healthy sandbox with an empty work dir and no leftover processes."""
    with pool.session(timeout=60) as sb:
        r = sb.exec("echo ok; ls -A /work /tmp", timeout=20)
        assert r.exit_code == 0 and r.stdout.split() == ["ok", "/tmp:", "/work:"], r
        leftovers = [p for p in procs(sb) if p.startswith(("sleep 3", "yes", "python3 -c while", "python3 -c chunks"))]
        assert not leftovers, leftovers


def test_no_network_dns_or_raw_ip(pool):
    code = (
        "import socket\n"
        "for what, fn in [('dns', lambda: socket.getaddrinfo('deb.debian.org', 80)),\n"
        "                 ('tcp', lambda: socket.create_connection(('1.1.1.1', 53), timeout=3)),\n"
        "                 ('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53)))]:\n"
        "    try:\n"
        "        fn()\n"
        "        print(what, 'OPEN')\n"
        "    except OSError as e:\n"
        "        print(what, 'blocked')\n"
        "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n"
    )
    with pool.session() as sb:
        r = sb.run_python(code, timeout=30)
    assert r.stdout.splitlines() == ["dns blocked", "tcp blocked", "udp blocked", "['lo']"], r
    assert_pool_serves(pool)


def test_cannot_write_outside_the_work_dir(pool):
    targets = ["/x", "/etc/x", "/usr/x", "/usr/bin/x", "/bin/x", "/var/x", "/root/x", "/home/x"]
    script = "; ".join(f"(echo pwn > {t}) 2>/dev/null && echo WROTE {t}" for t in targets)
    with pool.session() as sb:
        r = sb.exec(script + "; echo fine > /work/ok && echo fine > /tmp/ok && cat /work/ok /tmp/ok", timeout=20)
        assert "WROTE" not in r.stdout and r.stdout == "fine\nfine\n", r
        assert sb.run_python("import os; print(os.getuid(), os.geteuid())", timeout=20).stdout == "1000 1000\n"
        status = sb.exec("grep -E '^(CapEff|NoNewPrivs)' /proc/self/status", timeout=20).stdout.split()
        assert status == ["CapEff:", "0000000000000000", "NoNewPrivs:", "1"]
    assert_pool_serves(pool)


def test_work_dir_and_tmp_are_size_limited(pool):
    code = ("import sys\nfor d in ('/work', '/tmp'):\n    try:\n"
            "        with open(d + '/big', 'wb') as f:\n            for _ in range(200):\n"
            "                f.write(b'x' * 2**20)\n        print(d, 'FILLED 200 MiB')\n"
            "    except OSError as e:\n        print(d, 'full', e.errno)\n")
    with pool.session() as sb:
        r = sb.run_python(code, timeout=60)
    assert r.stdout.splitlines() == ["/work full 28", "/tmp full 28"], r  # 28 = ENOSPC
    assert_pool_serves(pool)


def test_fork_bomb(pool):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    with pool.session() as sb:
        t0 = time.monotonic()
        r = sb.run_python(bomb, timeout=3)
        assert r.timed_out and time.monotonic() - t0 < 30, r
        t0 = time.monotonic()
        sb.exec("f(){ f|f& }; f", timeout=3)  # the classic, in POSIX sh spelling; its group is killed after
        assert time.monotonic() - t0 < 30
        after = sb.exec("echo alive", timeout=20)
        assert after.stdout == "alive\n", after
        assert len(procs(sb)) < 10
    assert_pool_serves(pool)


def test_memory_bomb_is_oom_killed(pool):
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 2**20))\n"
    with pool.session() as sb:
        r = sb.run_python(bomb, timeout=60)
        assert r.oom_killed and r.exit_code == 137 and not r.timed_out, r
        assert sb.exec("echo alive", timeout=20).stdout == "alive\n"
    assert_pool_serves(pool)


def test_infinite_loop_times_out_and_is_killed(pool):
    with pool.session() as sb:
        t0 = time.monotonic()
        r = sb.run_python("while True: pass", timeout=1)
        assert r.timed_out and r.exit_code == 137 and not r.oom_killed, r
        assert 1.0 <= r.duration_s < 5 and time.monotonic() - t0 < 10
        assert not [p for p in procs(sb) if p.startswith("python3 -c while True")]
    assert_pool_serves(pool)


def test_output_flood_is_capped(pool):
    with pool.session() as sb:
        r = sb.exec("yes", timeout=2)
        assert r.timed_out and r.truncated and len(r.stdout.encode()) == 64 * 1024, (r.exit_code, len(r.stdout))
        r = sb.run_python("import sys\nsys.stdout.write('a' * 10_000_000)\nsys.stderr.write('b' * 10_000_000)\n",
                          timeout=30)
        assert r.exit_code == 0 and r.truncated
        assert r.stdout == "a" * 65536 and r.stderr == "b" * 65536
    assert_pool_serves(pool)


def test_sleeping_child_that_outlives_the_command(pool):
    with pool.session() as sb:
        t0 = time.monotonic()
        r = sb.exec("sleep 300 & echo started", timeout=30)
        assert r.stdout == "started\n" and r.exit_code == 0 and time.monotonic() - t0 < 5, r
        assert not [p for p in procs(sb) if p.startswith("sleep 300")]
        # A child that leaves the process group (setsid) and keeps the pipe open cannot hold the call...
        t0 = time.monotonic()
        r = sb.exec("setsid sleep 301 & echo escaped", timeout=30)
        assert r.stdout == "escaped\n" and time.monotonic() - t0 < 5, r
        # ...and does not survive the episode: reset kills every process of the agent's uid.
        sb.reset()
        assert not [p for p in procs(sb) if p.startswith("sleep 30")]
    assert_pool_serves(pool)


def test_kill_pid_1_and_kill_everything(pool):
    with pool.session() as sb:
        sb.write_files({"keep.txt": "still here"})
        sb.exec("kill -9 1", timeout=10)
        assert sb.exec("cat keep.txt", timeout=20).stdout == "still here"
        sb.exec("kill -9 -1", timeout=10)  # may take the executor with it (docker); it comes back
        r = sb.exec("cat keep.txt", timeout=20)
        assert r.stdout == "still here" and sb.alive, r
    assert_pool_serves(pool)


def test_process_that_closes_stdout_and_keeps_running(pool):
    code = "import os, time\nprint('bye', flush=True)\nos.close(1)\nos.close(2)\ntime.sleep(300)\n"
    with pool.session() as sb:
        t0 = time.monotonic()
        r = sb.run_python(code, timeout=2)
        assert r.timed_out and r.stdout == "bye\n" and time.monotonic() - t0 < 10, r
        assert not [p for p in procs(sb) if p.startswith("python3 -c import os, time")]
    assert_pool_serves(pool)
