"""The real thing: smg router + embedded engines (``python -m agentrl.engine``) on the tiny model.

One module-scoped fleet (3 engines, 2 of them registered at start) keeps the file fast; the tests run
in file order and each leaves the fleet usable for the next:
affinity + prefix reuse -> engine added at run time -> pause / update weights / continue -> engine killed
-> EngineWatch removes a killed engine and restarts it.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest
from rollout_helpers import http_json, seconds_until

from agentrl.rollout.client import RolloutClient
from agentrl.rollout.router import EngineWatch, SmgRouter

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PARAMS = {"max_new_tokens": 1, "temperature": 1.0, "ignore_eos": True}  # one token per turn keeps 200-turn runs short


class Fleet:
    def __init__(self, model_dir: Path, engines: list, router: SmgRouter) -> None:
        self.model_dir = model_dir
        self.engines = engines
        self.router = router


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    from agentrl.engine.launch import EngineProcess

    model_dir = tiny_model_dir
    engines = [EngineProcess(model_dir).start() for _ in range(3)]  # start in parallel
    router = None
    try:
        for engine in engines:
            engine.wait_healthy(180)
        router = SmgRouter([e.url for e in engines[:2]]).start()
        yield Fleet(Path(model_dir), engines, router)
    finally:
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()


def _requests_served(engine_url: str) -> float:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(engine_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("agentrl_engine_requests_total"))


async def _episodes(url: str, prefix: str, n_sessions: int, n_turns: int, params=PARAMS, **client_kw):
    """Concurrent multi-turn episodes; each session's prompt starts with a token unique to it."""
    async with RolloutClient(url, **client_kw) as client:

        async def episode(i: int):
            prompt = [1, 100 + i, 3, 4]
            turns = []
            for _ in range(n_turns):
                res = await client.generate(prompt, params, session_id=f"{prefix}-{i}")
                turns.append(res)
                prompt = [*prompt, *res.turn.output_ids, 2, 1, 5]
            return turns

        return await asyncio.gather(*(episode(i) for i in range(n_sessions)))


def _assert_each_turn_reused_the_previous_one(episodes) -> None:
    """Turn k hit the engine that holds turn k-1: its cached prefix covers at least the previous prompt.

    Sessions share only the first token, so a turn served by any other engine would report <= 1.
    """
    for turns in episodes:
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.cached_tokens >= len(prev.turn.prompt_ids), [t.cached_tokens for t in turns]


def test_sessions_stay_on_one_engine_and_cached_tokens_grow(fleet):
    before = [_requests_served(e.url) for e in fleet.engines[:2]]
    episodes = asyncio.run(_episodes(fleet.router.url, "aff", n_sessions=50, n_turns=4))
    assert len(episodes) == 50 and all(len(t) == 4 for t in episodes)
    _assert_each_turn_reused_the_previous_one(episodes)
    for turns in episodes:
        cached = [t.cached_tokens for t in turns]
        assert cached[0] <= 1 and all(b > a for a, b in zip(cached, cached[1:], strict=False)), cached
        for t in turns:
            assert t.turn.finish_reason == "length" and len(t.turn.output_ids) == len(t.turn.output_logprobs) == 1
            assert t.turn.weight_version == "default" and all(lp <= 0 for lp in t.turn.output_logprobs)
    served = [_requests_served(e.url) - b for e, b in zip(fleet.engines[:2], before, strict=True)]
    # Whole sessions per engine (multiples of 4 turns), both engines used, none lost.
    assert sum(served) == 200 and all(s % 4 == 0 and s >= 40 for s in served), served


def test_engine_added_at_run_time_receives_new_sessions(fleet):
    late = fleet.engines[2]
    before = _requests_served(late.url)
    fleet.router.add_worker(late.url)
    assert late.url in [w.url for w in fleet.router.workers()]
    episodes = asyncio.run(_episodes(fleet.router.url, "late", n_sessions=24, n_turns=2))
    _assert_each_turn_reused_the_previous_one(episodes)
    served = _requests_served(late.url) - before
    assert served >= 8 and served % 2 == 0, served  # several whole new sessions went to the new engine


def _perturbed_copy(model_dir: Path, out_dir: Path, scale: float = 0.05) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    from agentrl.engine.weight_loading import write_checksum_manifest

    shutil.copytree(model_dir, out_dir)
    for f in out_dir.glob("*.safetensors"):
        tensors = load_file(f)
        gen = torch.Generator().manual_seed(1234)
        perturbed = {k: (v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype)).contiguous()
                     for k, v in tensors.items()}
        save_file(perturbed, f, metadata={"format": "pt"})
    write_checksum_manifest(out_dir, out_dir.glob("*.safetensors"))  # engines refuse unchecked weights
    return out_dir


def _reference_logprobs(model_dir: Path, turns) -> list[list[float]]:
    """log_softmax of a plain transformers forward over prompt + output, at each output token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for turn in turns:
            ids = torch.tensor([[*turn.prompt_ids, *turn.output_ids]])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            n = len(turn.prompt_ids)
            refs.append([float(logp[n - 1 + i, tok]) for i, tok in enumerate(turn.output_ids)])
    return refs


def test_pause_update_continue_changes_version_and_logprobs_everywhere(fleet, tmp_path):
    new_dir = _perturbed_copy(fleet.model_dir, tmp_path / "step-1")
    router = fleet.router
    live = fleet.engines  # all three are registered now
    assert router.pause()["succeeded"] == 3
    assert router.update_weights_from_disk(str(new_dir), "step-1")["succeeded"] == 3
    assert router.continue_()["succeeded"] == 3
    for engine in live:
        assert http_json(engine.url + "/get_weight_version")["weight_version"] == "step-1"

    episodes = asyncio.run(_episodes(router.url, "upd", n_sessions=3, n_turns=1))

    async def one_per_engine():  # bypass the router so that every engine is checked for sure
        results = []
        for i, engine in enumerate(live):
            async with RolloutClient(engine.url) as client:
                results.append(await client.generate([1, 200 + i, 3], {"max_new_tokens": 3, "ignore_eos": True}, session_id="d"))
        return results

    turns = [res.turn for (res,) in episodes] + [res.turn for res in asyncio.run(one_per_engine())]
    assert all(turn.weight_version == "step-1" for turn in turns)
    new_model = _reference_logprobs(new_dir, turns)
    old_model = _reference_logprobs(fleet.model_dir, turns)
    for turn, ref_new, ref_old in zip(turns, new_model, old_model, strict=True):
        assert turn.output_logprobs == pytest.approx(ref_new, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(turn.output_logprobs, ref_old, strict=True)) > 1e-3


def test_engine_killed_mid_run_loses_no_episode(fleet):
    engines = fleet.engines
    params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}  # longer turns: requests are in flight at the kill
    before = [_requests_served(e.url) for e in engines]
    victim = None

    async def run():
        nonlocal victim
        task = asyncio.create_task(_episodes(fleet.router.url, "kill", n_sessions=16, n_turns=3, params=params,
                                             backoff=0.05, max_backoff=0.5))
        deadline = time.monotonic() + 120
        while victim is None:  # the first engine seen serving these episodes dies
            await asyncio.sleep(0.02)
            busy = [e for e, b in zip(engines, before, strict=True) if _requests_served(e.url) > b]
            victim = busy[0] if busy else None
            assert time.monotonic() < deadline, "no engine started serving the episodes"
        victim.kill()
        return await task

    episodes = asyncio.run(run())
    assert not victim.alive
    assert len(episodes) == 16 and all(len(t) == 3 for t in episodes)
    assert all(t.turn.finish_reason == "length" and len(t.turn.output_ids) == 6 for turns in episodes for t in turns)
    survivors = [e for e in engines if e is not victim]
    served = sum(_requests_served(e.url) - b for e, b in zip(engines, before, strict=True) if e is not victim)
    assert served >= 16, served  # the survivors did the rest
    assert all(e.alive for e in survivors)


def test_watch_removes_a_killed_engine_and_restarts_it(fleet):
    """agentrl's EngineWatch on the fleet's live registered engines (the last test: an engine it restarts
    dies with the watch's thread): a SIGKILLed engine leaves the router within seconds and the rest serve;
    with ``restart`` it comes back on its port, registered and serving."""
    router = fleet.router
    registered = {w.url for w in router.workers()}
    for dead in [e for e in fleet.engines if not e.alive and e.url in registered]:  # the previous test's victim
        router.remove_worker(dead.url)
    engines = [e for e in fleet.engines if e.alive and e.url in registered]
    assert len(engines) >= 2
    victim = engines[0]
    events: list[tuple[str, str]] = []
    watch = EngineWatch(router, engines, on_event=lambda url, what: events.append((url, what))).start()
    try:
        victim.kill()  # SIGKILL: no goodbye
        took = seconds_until(lambda: router.worker_id(victim.url) is None
                              or all(w.status != "ready" for w in router.workers() if w.url == victim.url), 10)
        assert took < 4 and (victim.url, "removed") in events
        episodes = asyncio.run(_episodes(router.url, "watch", n_sessions=8, n_turns=1))
        assert all(len(res.turn.output_ids) == 1 for (res,) in episodes)
    finally:
        watch.stop()
    # with restart: the same engine comes back on its port and serves again
    watch = EngineWatch(router, engines, restart=True, startup_timeout=180,
                        on_event=lambda url, what: events.append((url, what)))
    watch.removed.add(victim.url)
    watch.start()
    try:
        seconds_until(lambda: (victim.url, "restarted") in events, 200)
        ready = {w.url for w in router.workers() if w.status == "ready" and w.is_healthy}
        assert ready == {e.url for e in engines} and victim.alive
    finally:
        watch.stop()
