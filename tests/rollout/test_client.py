"""RolloutClient behaviour against small in-process aiohttp servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from agentrl.rollout.client import (
    ROUTING_KEY_HEADER,
    GenerateRequestError,
    GenerateRetriesExhausted,
    GenerateTimeoutError,
    MalformedResponseError,
    RolloutClient,
    parse_generate_response,
)
from agentrl.rollout.router import free_port

pytestmark = pytest.mark.timeout(60)

FAST = {"backoff": 0.01, "max_backoff": 0.05}


def answer(ids: list[int], rid: str = "x", version: str | None = "v1", finish: str = "length") -> dict:
    out = [(ids[-1] + 1) % 1024, (ids[-1] + 2) % 1024]
    return {
        "text": "ab",
        "output_ids": out,
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": finish},
            "cached_tokens": 3,
            "weight_version": version,
            "output_token_logprobs": [[-0.25, out[0], None], [-1.5, out[1], None]],
        },
    }


class FaultServer:
    """An engine whose /generate behaviour is a per-test coroutine; records requests and aborts."""

    def __init__(self, generate: Callable[[web.Request, dict, int], Awaitable[web.StreamResponse]]) -> None:
        self.generate_impl = generate
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.aborted: list[str] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._runner: web.AppRunner | None = None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        return await self.generate_impl(request, body, len(self.bodies))

    async def _abort(self, request: web.Request) -> web.Response:
        self.aborted.append((await request.json())["rid"])
        return web.json_response({"success": True})

    async def __aenter__(self) -> FaultServer:
        app = web.Application()
        app.add_routes([web.post("/generate", self._generate), web.post("/abort_request", self._abort)])
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


def run(coro):
    return asyncio.run(coro)


def test_request_shape_and_result_fields():
    async def ok(request, body, n):
        return web.json_response(answer(body["input_ids"], body["rid"]))

    async def main():
        async with FaultServer(ok) as srv, RolloutClient(srv.url) as client:
            res = await client.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 1.0},
                                        session_id="sess-1", rid="my-rid")
            body, headers = srv.bodies[0], srv.headers[0]
            assert headers[ROUTING_KEY_HEADER] == "sess-1"
            assert body == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 1.0},
                            "return_logprob": True, "rid": "my-rid"}
            assert res.turn.prompt_ids == (1, 2, 3) and res.turn.output_ids == (4, 5)
            assert res.turn.output_logprobs == (-0.25, -1.5)
            assert res.turn.finish_reason == "length" and isinstance(res.turn.finish_reason, str)
            assert res.turn.weight_version == "v1" and res.cached_tokens == 3 and res.text == "ab"
            assert res.meta["id"] == "my-rid" and res.rid == "my-rid"

            turn = await client.generate_turn([7, 8], session_id="sess-2", sampling_params={"max_new_tokens": 2})
            assert type(turn).__name__ == "TurnRecord"
            assert (turn.prompt_ids, turn.output_ids, turn.output_logprobs) == ((7, 8), (9, 10), (-0.25, -1.5))
            assert turn.finish_reason == "length" and turn.weight_version == "v1"
            assert srv.headers[1][ROUTING_KEY_HEADER] == "sess-2"
            assert srv.bodies[1]["rid"] != srv.bodies[0]["rid"]

    run(main())


def test_5xx_is_retried_with_fresh_rids_until_success():
    async def flaky(request, body, n):
        if n <= 2:
            return web.json_response({"error": {"message": "worker died"}}, status=502 if n == 1 else 503)
        return web.json_response(answer(body["input_ids"], body["rid"]))

    async def main():
        async with FaultServer(flaky) as srv, RolloutClient(srv.url, **FAST) as client:
            res = await client.generate([1], session_id="s", rid="base")
            assert res.turn.output_ids == (2, 3)
            assert client.retries == 2
            assert [b["rid"] for b in srv.bodies] == ["base", "base-retry1", "base-retry2"]
            assert res.rid == "base-retry2"

    run(main())


def test_cut_stream_and_unparsable_200_are_retried():
    async def cut(request, body, n):
        if n == 1:  # promise a long body, send half, drop the connection
            resp = web.StreamResponse(status=200, headers={"Content-Length": "1000"})
            await resp.prepare(request)
            await resp.write(b'{"text": "', )
            request.transport.close()
            return resp
        if n == 2:
            return web.Response(status=200, text='{"text": "truncated', content_type="application/json")
        return web.json_response(answer(body["input_ids"]))

    async def main():
        async with FaultServer(cut) as srv, RolloutClient(srv.url, **FAST) as client:
            res = await client.generate([1, 2], session_id="s")
            assert res.turn.output_ids == (3, 4) and client.retries == 2 and len(srv.bodies) == 3

    run(main())


@pytest.mark.parametrize("status", [400, 404, 422])
def test_4xx_is_not_retried_and_carries_the_server_message(status):
    async def reject(request, body, n):
        return web.json_response({"error": {"message": f"prompt too long (code {status})"}}, status=status)

    async def main():
        async with FaultServer(reject) as srv, RolloutClient(srv.url, **FAST) as client:
            with pytest.raises(GenerateRequestError) as err:
                await client.generate([1], session_id="s")
            assert err.value.status == status
            assert err.value.message == f"prompt too long (code {status})"
            assert str(status) in str(err.value) and len(srv.bodies) == 1 and client.retries == 0

    run(main())


def test_plain_text_and_fastapi_error_bodies_are_reported():
    async def reject(request, body, n):
        if n == 1:
            return web.Response(status=400, text="Failed to deserialize the JSON body")
        return web.json_response({"detail": "max_new_tokens must be > 0"}, status=400)

    async def main():
        async with FaultServer(reject) as srv, RolloutClient(srv.url) as client:
            with pytest.raises(GenerateRequestError, match="Failed to deserialize"):
                await client.generate([1], session_id="s")
            with pytest.raises(GenerateRequestError, match="max_new_tokens must be > 0"):
                await client.generate([1], session_id="s")

    run(main())


def test_429_is_retried():
    async def busy(request, body, n):
        if n == 1:
            return web.Response(status=429, text="queue full")
        return web.json_response(answer(body["input_ids"]))

    async def main():
        async with FaultServer(busy) as srv, RolloutClient(srv.url, **FAST) as client:
            assert (await client.generate([1], session_id="s")).turn.output_ids == (2, 3)
            assert client.retries == 1

    run(main())


def test_retries_are_bounded_by_count_and_by_budget():
    async def always_down(request, body, n):
        return web.Response(status=500, text="boom")

    async def main():
        async with FaultServer(always_down) as srv:
            async with RolloutClient(srv.url, max_retries=3, **FAST) as client:
                with pytest.raises(GenerateRetriesExhausted, match="failed 4 times") as err:
                    await client.generate([1], session_id="s")
                assert "boom" in str(err.value.__cause__) and len(srv.bodies) == 4
            async with RolloutClient(srv.url, max_retries=100, backoff=0.05, max_backoff=0.05,
                                     retry_budget_s=0.3) as client:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                with pytest.raises(GenerateRetriesExhausted, match="retry budget"):
                    await client.generate([1], session_id="s")
                assert loop.time() - t0 < 1.0

    run(main())


def test_connection_refused_is_retried_then_reported():
    async def main():
        url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        async with RolloutClient(url, max_retries=2, **FAST) as client:
            with pytest.raises(GenerateRetriesExhausted, match="failed 3 times"):
                await client.generate([1], session_id="s")
            assert client.retries == 2

    run(main())


def test_engine_coming_back_during_retries_saves_the_request():
    async def ok(request, body, n):
        return web.json_response(answer(body["input_ids"]))

    async def main():
        srv = FaultServer(ok)
        async with RolloutClient(srv.url, backoff=0.05, max_backoff=0.1, max_retries=20) as client:
            task = asyncio.create_task(client.generate([4], session_id="s"))
            await asyncio.sleep(0.2)  # a few refused attempts
            async with srv:
                res = await asyncio.wait_for(task, 5)
            assert res.turn.output_ids == (5, 6) and client.retries >= 1

    run(main())


def test_timeout_aborts_the_request_on_the_engine():
    async def slow(request, body, n):
        await asyncio.sleep(5)
        return web.json_response(answer(body["input_ids"]))

    async def main():
        async with FaultServer(slow) as srv, RolloutClient(srv.url, timeout=0.3, **FAST) as client:
            with pytest.raises(GenerateTimeoutError, match="exceeded 0.3 s"):
                await client.generate([1], session_id="s", rid="slow-1")
            assert srv.aborted == ["slow-1"] and len(srv.bodies) == 1  # a timeout is not retried

    run(main())


def test_cancellation_aborts_the_request_and_propagates():
    async def main():
        seen = asyncio.Event()

        async def hang(request, body, n):
            seen.set()
            await asyncio.sleep(30)
            return web.json_response(answer(body["input_ids"]))

        async with FaultServer(hang) as srv, RolloutClient(srv.url) as client:
            task = asyncio.create_task(client.generate([1], session_id="s", rid="cancel-me"))
            await asyncio.wait_for(seen.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert srv.aborted == ["cancel-me"]

    run(main())


def test_malformed_200_answers_raise_a_clear_error():
    bad_answers = [
        {"text": "", "output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "stop"},
                                                          "output_token_logprobs": [[-1.0, 1, None]]}},
        {"text": "", "meta_info": {}},
        [answer([1]), answer([2])],
    ]

    async def bad(request, body, n):
        return web.json_response(bad_answers[n - 1])

    async def main():
        async with FaultServer(bad) as srv, RolloutClient(srv.url) as client:
            with pytest.raises(MalformedResponseError, match="1 log-probs for 2 output tokens"):
                await client.generate([1], session_id="s")
            with pytest.raises(MalformedResponseError, match="output_ids"):
                await client.generate([1], session_id="s")
            with pytest.raises(MalformedResponseError, match="n > 1"):
                await client.generate([1], session_id="s")
            assert client.retries == 0

    run(main())


def test_bad_arguments_are_rejected_before_any_request():
    async def main():
        async with RolloutClient("http://127.0.0.1:9") as client:
            with pytest.raises(ValueError, match="session_id"):
                await client.generate([1], session_id="")
            with pytest.raises(ValueError, match="input_ids"):
                await client.generate([], session_id="s")
            with pytest.raises((TypeError, ValueError)):
                await client.generate(["a"], session_id="s")
            with pytest.raises(ValueError, match=r"\['n'\] must be 1"):
                await client.generate([1], {"n": 4}, session_id="s")

    run(main())
    with pytest.raises(ValueError, match="timeout"):
        RolloutClient("http://x", timeout=0)


def test_parse_accepts_abort_and_missing_logprobs():
    res = parse_generate_response([1], {"text": "", "output_ids": [],
                                        "meta_info": {"finish_reason": {"type": "abort", "message": "paused"}}})
    assert res.turn.finish_reason == "abort" and res.turn.output_ids == () and res.turn.weight_version is None
    assert res.cached_tokens == 0
    res = parse_generate_response([1], json.loads(json.dumps(answer([1], version=None, finish="stop"))))
    assert res.turn.finish_reason == "stop" and res.turn.weight_version is None


def test_one_client_survives_several_event_loops():
    async def ok(request, body, n):
        return web.json_response(answer(body["input_ids"]))

    srv = FaultServer(ok)  # restarted on the same port inside each loop
    client = RolloutClient(srv.url)

    async def one_call(i: int):
        async with srv:
            return await client.generate([i], session_id="s")

    assert run(one_call(1)).turn.output_ids == (2, 3)
    assert run(one_call(5)).turn.output_ids == (6, 7)  # a new loop: the pool is rebuilt, not reused

    async def close():
        await client.aclose()

    run(close())


def test_the_record_holds_the_prompt_as_sent_even_if_the_caller_changes_its_list():
    import numpy as np

    async def ok(request, body, n):
        await asyncio.sleep(0.05)
        return web.json_response(answer(body["input_ids"], body["rid"]))

    async def main():
        async with FaultServer(ok) as srv, RolloutClient(srv.url) as client:
            ids = [1, 2, 3]
            task = asyncio.create_task(client.generate(ids, session_id="s"))
            await asyncio.sleep(0.01)
            ids.append(99)  # the agent loop's list, changed while the request is out
            res = await task
            assert res.turn.prompt_ids == (1, 2, 3) and srv.bodies[0]["input_ids"] == [1, 2, 3]
            res = await client.generate(np.array([5, 6], dtype=np.int64), session_id="s")  # numpy ids: plain ints
            assert res.turn.prompt_ids == (5, 6) and all(type(t) is int for t in res.turn.prompt_ids)

    run(main())
