"""No episode can read an earlier episode's bytes from its own memory: ``run_python`` children are
forked from a zygote that was forked before the sandbox served anything, never from the executor that
has handled (and still holds, in freed heap) earlier episodes' code and output. On both backends."""

from __future__ import annotations

import json
import uuid

import pytest

pytestmark = pytest.mark.timeout(180)

PREFIX = "AGENTRL-LEAK-"
# Scans every readable mapping of its own process for PREFIX + 32 hex digits and prints what it found.
# Its own source holds PREFIX followed by a quote only; SELF is built at run time so that finding it
# proves the scan reads this process's heap.
SCAN = '''
import json, re
pattern = re.compile(rb"AGENTRL-LEAK-[0-9a-f]{32}")
SELF = ("AGENTRL-LEAK-" + "e" * 32).encode()
found = set()
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", buffering=0) as mem:
    for line in maps:
        span, perms = line.split()[:2]
        if not perms.startswith("r") or line.rstrip().endswith(("[vvar]", "[vsyscall]", "[vvar_vclock]")):
            continue
        start, end = (int(x, 16) for x in span.split("-"))
        try:
            mem.seek(start)
            found.update(m.decode() for m in pattern.findall(mem.read(end - start)))
        except (OSError, ValueError, OverflowError):
            continue
print(json.dumps(sorted(found)))
'''


def _plant(sb, calls: int) -> set[str]:
    markers = set()
    for _ in range(calls):
        token = uuid.uuid4().hex
        out_token = token[::-1]  # only ever in the output, built at run time
        code = f"x = {PREFIX + token!r}\nprint('{PREFIX}' + {token!r}[::-1])\n"
        res = sb.run_python(code, timeout=20)
        assert res.exit_code == 0 and res.stdout.strip() == PREFIX + out_token, res
        markers |= {PREFIX + token, PREFIX + out_token}
    return markers


@pytest.mark.parametrize("calls", [1, 25])
def test_a_later_episode_finds_no_earlier_episodes_code_or_output_in_its_memory(solo_pool, calls):
    with solo_pool.session(timeout=60) as sb:
        first = id(sb)
        planted = _plant(sb, calls)
    with solo_pool.session(timeout=60) as sb:
        assert id(sb) == first, "a pool of one hands out the same sandbox"
        res = sb.run_python(SCAN, timeout=60)
    assert res.exit_code == 0, res
    found = set(json.loads(res.stdout))
    assert PREFIX + "e" * 32 in found, "the scan must see its own heap, else it proves nothing"
    assert not found & planted, f"leaked from the earlier episode: {sorted(found & planted)[:4]}"


def test_calls_of_one_episode_still_work_after_the_agent_kills_the_zygote(solo_pool):
    """Killing every other process of the agent uid (the zygote included) degrades run_python to a
    fresh interpreter, never to a fork of the executor."""
    with solo_pool.session(timeout=60) as sb:
        sb.exec("kill -9 -1", timeout=20)
        planted = _plant(sb, 2)
    with solo_pool.session(timeout=60) as sb:
        res = sb.run_python(SCAN, timeout=60)
    found = set(json.loads(res.stdout))
    assert PREFIX + "e" * 32 in found and not found & planted


_pools: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    for pool in _pools.values():
        pool.close()
    _pools.clear()


@pytest.fixture
def solo_pool(backend):
    from agentrl.sandbox import SandboxPool

    if backend not in _pools:
        _pools[backend] = SandboxPool(size=1, backend=backend).start()
    return _pools[backend]


FORKED = "import sys\nprint('--contained' in open('/proc/self/cmdline').read())\n"


def test_run_python_keeps_forking_from_the_zygote_across_episodes(solo_pool):
    """Every episode's run_python is a fork of the zygote (whose command line is the executor's), not the
    fresh-interpreter fallback: a reset that kills the spare child while the zygote forks the next one
    must not cost the zygote (it did: the sandbox then started a python3 per call)."""
    for _ in range(4):
        with solo_pool.session(timeout=60) as sb:
            sb.exec("sleep 30 >/dev/null 2>&1 &", timeout=20)  # a leftover for the reset to kill
            for _ in range(2):
                res = sb.run_python(FORKED, timeout=20)
                assert res.exit_code == 0 and res.stdout == "True\n", res
