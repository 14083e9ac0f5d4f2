"""Weight updates (disk, tensor, distributed, delta) change weights_checksum and weight_version exactly,
bitwise equal to the source; failed updates keep the old weights and version; memory release/resume."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
import torch

from agentrl.engine.auth import auth_headers
from agentrl.engine.weight_loading import update_weights_from_tensor_body, weights_checksum

PROMPT = [1, 30, 31, 32, 33]


def load_params(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def params_a(tiny_model):
    return load_params(tiny_model)


@pytest.fixture(scope="module")
def params_b(tiny_model_b):
    return load_params(tiny_model_b)


def checksum(client) -> dict:
    r = client.get("/weights_checksum")
    assert r.status_code == 200, r.text
    return r.json()


def reset(client, tiny_model, version: str = "A") -> None:
    r = client.post("/update_weights_from_disk", json={"allow_missing_manifest": True, "model_path": str(tiny_model), "weight_version": version})
    assert r.status_code == 200, r.text


def assert_unchanged(client, before: dict) -> None:
    after = checksum(client)
    assert after["total"] == before["total"] and after["weight_version"] == before["weight_version"]


def test_checksum_matches_the_checkpoint_bitwise(client, params_a, tiny_model):
    reset(client, tiny_model)
    ours = checksum(client)
    ref = weights_checksum(params_a.items())
    assert ours["total"] == ref["total"]
    assert list(ours["parameters"]) == list(params_a)  # HF named_parameters order


def test_update_from_disk(client, tiny_model, tiny_model_b, params_b, hf_logprobs):
    reset(client, tiny_model)
    client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
    r = client.post("/update_weights_from_disk", json={"allow_missing_manifest": True, "model_path": str(tiny_model_b), "weight_version": "B"})
    assert r.status_code == 200 and r.json()["success"]
    assert checksum(client)["total"] == weights_checksum(params_b.items())["total"]
    assert client.get("/model_info").json()["model_path"] == str(tiny_model_b)
    out = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}, "return_logprob": True}).json()
    assert out["meta_info"]["weight_version"] == "B"
    assert out["meta_info"]["cached_tokens"] == 0  # the update flushed the prefix cache
    from transformers import AutoModelForCausalLM

    model_b = AutoModelForCausalLM.from_pretrained(tiny_model_b, dtype=torch.float32).eval()
    ref = hf_logprobs(model_b, PROMPT, out["output_ids"])
    ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-5


def test_failed_disk_updates_keep_old_weights(client, tiny_model, tmp_path):
    from agentrl.models.tiny import make_tiny_model

    reset(client, tiny_model)
    before = checksum(client)
    r = client.post("/update_weights_from_disk", json={"allow_missing_manifest": True, "model_path": str(tmp_path / "nope"), "weight_version": "X"})
    assert r.status_code == 400 and not r.json()["success"] and "nope" in r.json()["message"]
    assert_unchanged(client, before)
    other_shape = make_tiny_model(tmp_path / "wide", seed=3, intermediate_size=256)
    r = client.post("/update_weights_from_disk", json={"allow_missing_manifest": True, "model_path": str(other_shape), "weight_version": "X"})
    assert r.status_code == 400 and "shape mismatch" in r.json()["message"]
    assert_unchanged(client, before)
    assert client.get("/model_info").json()["model_path"] == str(tiny_model)


@pytest.mark.parametrize("fmt", ["safetensors", None])
def test_update_from_tensor(client, tiny_model, params_b, fmt):
    reset(client, tiny_model)
    body = update_weights_from_tensor_body(params_b.items(), weight_version=f"T-{fmt}", fmt=fmt)
    r = client.post("/update_weights_from_tensor", json=body)
    assert r.status_code == 200, r.text
    after = checksum(client)
    assert after["total"] == weights_checksum(params_b.items())["total"]
    assert after["weight_version"] == f"T-{fmt}"


def test_partial_tensor_update_changes_only_that_tensor(client, tiny_model, params_a):
    reset(client, tiny_model)
    before = checksum(client)["parameters"]
    name = "model.layers.1.mlp.down_proj.weight"
    new = params_a[name] + 1.0
    r = client.post("/update_weights_from_tensor", json=update_weights_from_tensor_body([(name, new)], weight_version="P"))
    assert r.status_code == 200
    after = checksum(client)["parameters"]
    assert [n for n in before if before[n] != after[n]] == [name]


@pytest.mark.parametrize(
    ("named", "needle"),
    [
        ([("model.not_a_param", torch.zeros(2))], "unknown parameter"),
        ([("model.norm.weight", torch.zeros(3))], "shape mismatch"),
        ([("model.norm.weight", torch.zeros(128)), ("lm_head.bogus", torch.zeros(1))], "unknown parameter"),
    ],
)
def test_bad_tensor_updates_keep_old_weights(client, tiny_model, named, needle):
    reset(client, tiny_model)
    before = checksum(client)
    r = client.post("/update_weights_from_tensor", json=update_weights_from_tensor_body(named, weight_version="bad"))
    assert r.status_code == 400 and needle in r.json()["message"]
    assert_unchanged(client, before)
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["@@not base64@@"], "load_format": "safetensors"})
    assert r.status_code == 400 and "base64" in r.json()["message"]
    assert_unchanged(client, before)


def test_delta_update_and_rejections(client, tiny_model, params_a, params_b, tmp_path):
    encode = pytest.importorskip("agentrl.weights.delta").encode_delta
    reset(client, tiny_model, version="A")
    triples = [(n, params_a[n], params_b[n]) for n in params_a]
    payload, _ = encode(triples, base_version="A", new_version="B")
    path = tmp_path / "a_to_b.delta"
    path.write_bytes(payload)
    r = client.post("/update_weights_from_delta", json={"path": str(path), "weight_version": "B", "base_version": "A"})
    assert r.status_code == 200, r.text
    after = checksum(client)
    assert after["total"] == weights_checksum(params_b.items())["total"] and after["weight_version"] == "B"
    # replaying it (based on A, engine holds B) is out of order: 409, nothing changes
    r = client.post("/update_weights_from_delta", json={"path": str(path), "weight_version": "B2"})
    assert r.status_code == 409, r.text
    assert_unchanged(client, after)
    r = client.post("/update_weights_from_delta", json={"path": str(path), "base_version": "A"})
    assert r.status_code == 409
    # a corrupt payload: 400, nothing changes
    reset(client, tiny_model, version="A")
    before = checksum(client)
    broken = bytearray(payload)
    broken[len(broken) // 2] ^= 0xFF
    bad = tmp_path / "broken.delta"
    bad.write_bytes(bytes(broken))
    r = client.post("/update_weights_from_delta", json={"path": str(bad), "weight_version": "B"})
    assert r.status_code == 400 and "old weights kept" in r.json()["message"]
    assert_unchanged(client, before)
    r = client.post("/update_weights_from_delta", json={"path": str(tmp_path / "missing.delta")})
    assert r.status_code == 400 and "cannot read" in r.json()["error"]["message"]


def test_release_and_resume_memory(client, tiny_model):
    reset(client, tiny_model)
    before = checksum(client)
    assert client.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache"]}).json()["success"]
    r = client.post("/generate", json={"input_ids": PROMPT})
    assert r.status_code == 503 and "resume_memory_occupation" in r.json()["error"]["message"]
    assert client.get("/weights_checksum").status_code == 503
    assert client.get("/health").status_code == 200
    r = client.post("/update_weights_from_disk", json={"allow_missing_manifest": True, "model_path": str(tiny_model)})
    assert r.status_code == 400 and "released" in r.json()["message"]
    assert client.post("/resume_memory_occupation", json={}).json()["success"]
    assert_unchanged(client, before)
    assert client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    r = client.post("/release_memory_occupation", json={"tags": ["gpu_cache_of_doom"]})
    assert r.status_code == 400 and "unknown memory tag" in r.json()["message"]


def test_update_from_distributed_gloo_with_the_test_process_as_rank_0(tiny_model, params_a, params_b):
    """The engine runs in its own process (rank 1); this process is the trainer (rank 0)."""
    from agentrl.engine.launch import EngineProcess, free_port
    from agentrl.engine.weight_group import broadcast, destroy_group, init_custom_process_group

    port = free_port()
    eng = EngineProcess(tiny_model).start()
    eng.wait_healthy(timeout=180)  # generous: CI machines may be busy
    with eng, httpx.Client(base_url=eng.url, timeout=120, headers=auth_headers(eng.secret)) as client:
        replies: dict[str, httpx.Response] = {}

        def call(key: str, path: str, body: dict) -> threading.Thread:
            t = threading.Thread(target=lambda: replies.__setitem__(key, client.post(path, json=body)))
            t.start()
            return t

        init = call("init", "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "test_group", "backend": "gloo",
        })
        group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name="test_group")
        init.join()
        assert replies["init"].status_code == 200, replies["init"].text
        assert client.get("/health").status_code == 200
        names = list(params_b)
        update = call("update", "/update_weights_from_distributed", {
            "names": names, "dtypes": ["float32"] * len(names), "shapes": [list(params_b[n].shape) for n in names],
            "group_name": "test_group", "weight_version": "D1",
        })
        for n in names:
            broadcast(params_b[n].contiguous(), group, src=0)
        update.join()
        assert replies["update"].status_code == 200, replies["update"].text
        after = client.get("/weights_checksum").json()
        assert after["total"] == weights_checksum(params_b.items())["total"]
        assert after["weight_version"] == "D1"
        # a call naming a wrong shape fails before any broadcast is expected; weights stay
        r = client.post("/update_weights_from_distributed", json={
            "names": [names[0]], "dtypes": ["float32"], "shapes": [[3, 3]], "group_name": "test_group", "weight_version": "D2",
        })
        assert r.status_code == 400 and "shape mismatch" in r.json()["message"]
        assert client.get("/weights_checksum").json()["weight_version"] == "D1"
        # a delta payload over the same group: D1 (= B) -> A, bitwise, as one uint8 broadcast
        from agentrl.engine.weight_group import broadcast_bytes
        from agentrl.weights.delta import encode_delta

        payload, _ = encode_delta([(n, params_b[n], params_a[n]) for n in names], base_version="D1", new_version="DA")

        def send_delta(key: str, data: bytes, base: str) -> httpx.Response:
            thread = call(key, "/update_weights_from_delta_distributed", {
                "group_name": "test_group", "nbytes": len(data), "base_version": base, "weight_version": "DA",
            })
            broadcast_bytes(data, group, torch.device("cpu"))
            thread.join()
            return replies[key]

        r = send_delta("delta", payload, "D1")
        assert r.status_code == 200, r.text
        after = client.get("/weights_checksum").json()
        assert after["total"] == weights_checksum(params_a.items())["total"] and after["weight_version"] == "DA"
        # replayed (out of order) and flipped-byte payloads: received in full, then refused; weights stay
        assert send_delta("replay", payload, "D1").status_code == 409
        broken = bytearray(payload)
        broken[len(broken) // 2] ^= 0xFF
        r = send_delta("broken", bytes(broken), "DA")
        assert r.status_code == 400 and "old weights kept" in r.json()["message"]
        assert client.get("/weights_checksum").json() == after
        assert client.post("/destroy_weights_update_group", json={"group_name": "test_group"}).status_code == 200
        destroy_group(group)
        # SGLang's default tensor format across processes: CPU tensors travel through shared memory
        body = update_weights_from_tensor_body(params_a.items(), weight_version="mp", fmt=None)
        r = client.post("/update_weights_from_tensor", json=body)
        assert r.status_code == 200, r.text
        assert client.get("/weights_checksum").json()["total"] == weights_checksum(params_a.items())["total"]
    # stop() = SIGTERM; uvicorn shuts down gracefully, then re-raises the signal (exit -15), no SIGKILL
    assert not eng.alive and eng.proc.returncode in (0, -15), (eng.proc.returncode, eng.log_tail())


def test_retract_update_continue_switches_weights_mid_request(client, server, tiny_model, tiny_model_b, hf_logprobs):
    """pause(retract) -> update -> continue: tokens before the pause come from the old weights, every
    token after it from the new ones (the request is re-prefilled), and it reports the new version."""
    import time

    from transformers import AutoModelForCausalLM

    reset(client, tiny_model, version="A")
    result: dict = {}
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}}
    t = threading.Thread(target=lambda: result.update(httpx.post(server.url + "/generate", json=body, timeout=120).json()))
    t.start()
    deadline = time.monotonic() + 60
    while client.get("/get_load").json()[0]["num_tokens"] < len(PROMPT) + 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert client.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    r = client.post("/update_weights_from_disk", json={"allow_missing_manifest": True, "model_path": str(tiny_model_b), "weight_version": "B"})
    assert r.status_code == 200
    client.post("/continue_generation", json={})
    t.join(60)
    assert result["meta_info"]["weight_version"] == "B"
    assert result["meta_info"]["completion_tokens"] == 150
    out = result["output_ids"]
    ours = [lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]
    ref_a = hf_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval(), PROMPT, out)
    ref_b = hf_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_b, dtype=torch.float32).eval(), PROMPT, out)
    k = next(i for i, (x, a) in enumerate(zip(ours, ref_a, strict=True)) if abs(x - a) >= 1e-5)
    assert 0 < k < len(out)
    assert all(abs(x - b) < 1e-5 for x, b in zip(ours[k:], ref_b[k:], strict=True))


@pytest.mark.parametrize("fmt", ["safetensors", None])
def test_tensor_update_from_views_of_one_flat_bucket(client, tiny_model, params_b, fmt):
    """Trainers send buckets: every tensor a view into one flat buffer (shared storage)."""
    reset(client, tiny_model)
    flat = torch.cat([t.reshape(-1) for t in params_b.values()])
    views, offset = [], 0
    for name, t in params_b.items():
        views.append((name, flat[offset : offset + t.numel()].view(t.shape)))
        offset += t.numel()
    r = client.post("/update_weights_from_tensor", json=update_weights_from_tensor_body(views, weight_version="flat", fmt=fmt))
    assert r.status_code == 200, r.text
    assert checksum(client)["total"] == weights_checksum(params_b.items())["total"]


def flat_body(params: dict[str, torch.Tensor], *, version: str, entries=None) -> dict:
    """A ``flat_buckets`` body: every tensor of ``params`` in one flat CPU (shared-memory) bucket."""
    from agentrl.engine.weight_loading import flat_buckets_body

    flat = torch.cat([t.reshape(-1) for t in params.values()])
    if entries is None:
        entries, offset = [], 0
        for name, t in params.items():
            entries.append((name, tuple(t.shape), offset, t.numel()))
            offset += t.numel()
    return flat_buckets_body([("k0", flat, entries)], owner="test", weight_version=version)


def test_flat_buckets_update_is_bitwise_and_reports_where_time_went(client, server, tiny_model, params_b):
    reset(client, tiny_model)
    r = client.post("/update_weights_from_tensor", json=flat_body(params_b, version="FLAT"))
    assert r.status_code == 200, r.text
    after = checksum(client)
    assert after["total"] == weights_checksum(params_b.items())["total"] and after["weight_version"] == "FLAT"
    assert set(r.json()["timings"]) == {"ipc_open_s", "check_s", "wait_s", "copy_s", "version_s"}
    assert server.engine.kept_buffers == {}  # only CUDA buckets are held open; shared memory is not pinned


def raw_flat_body(payload) -> dict:
    """A ``flat_buckets`` body around any pickled ``payload`` (what a buggy sender could send)."""
    import base64

    import torch.multiprocessing as mp

    from agentrl.engine.cuda_ipc import dumps

    mp.set_sharing_strategy("file_system")
    return {"serialized_named_tensors": [base64.b64encode(dumps(payload)).decode()], "load_format": "flat_buckets",
            "weight_version": "bad"}


def test_malformed_flat_buckets_keep_the_old_weights(client, tiny_model, params_b):
    reset(client, tiny_model)
    before = checksum(client)
    name, t = next((n, p) for n, p in params_b.items() if p.dim() == 2)
    total = sum(p.numel() for p in params_b.values())
    flat = torch.cat([p.reshape(-1) for p in params_b.values()])
    cases = {
        "do not fit": [[name, list(t.shape), total - 1, t.numel()]],  # runs past the bucket's end
        "shape": [[name, [t.numel() + 1], 0, t.numel()]],  # numel disagrees with the shape
        "unknown parameter": [["model.not_a_layer.weight", list(t.shape), 0, t.numel()]],
        "not a new string": [[name, list(t.shape), 0, t.numel()], [name, list(t.shape), 0, t.numel()]],
        "not [name, shape, offset, numel]": [[name, list(t.shape), 0]],
    }
    for needle, entries in cases.items():
        payload = {"owner": "o", "buckets": [{"key": None, "flat": flat, "entries": entries}]}
        r = client.post("/update_weights_from_tensor", json=raw_flat_body(payload))
        assert r.status_code == 400 and needle in r.json()["message"], (needle, r.text)
        assert_unchanged(client, before)
    for needle, payload in {
        "'owner'": [("w", flat)],  # SGLang's per-tensor list under the flat format's name
        "1-D": {"owner": "o", "buckets": [{"key": None, "flat": t, "entries": [[name, list(t.shape), 0, t.numel()]]}]},
    }.items():
        r = client.post("/update_weights_from_tensor", json=raw_flat_body(payload))
        assert r.status_code == 400 and needle in r.json()["message"], (needle, r.text)
    assert_unchanged(client, before)


def test_dropping_kept_buffers_changes_nothing_else(client, tiny_model):
    from agentrl.engine.weight_loading import flat_buckets_body

    reset(client, tiny_model)
    before = checksum(client)
    r = client.post("/update_weights_from_tensor", json=flat_buckets_body([], owner="gone", flush_cache=False,
                                                                          drop_kept=True))
    assert r.status_code == 200 and r.json()["success"], r.text
    assert_unchanged(client, before)


def test_only_the_latest_senders_cuda_buffers_are_held():
    """CUDA buckets stay mapped for their sender's next sync; CPU ones never, a replaced sender's not."""
    from types import SimpleNamespace

    from agentrl.engine.engine import Engine

    def buf(kind: str):
        return SimpleNamespace(device=SimpleNamespace(type=kind))

    state = SimpleNamespace(kept_buffers={})
    keep = Engine.keep_buffers.__get__(state)
    keep("a", {"0": buf("cuda"), "1": buf("cpu")})
    keep("a", {"2": buf("cuda")})
    assert {o: sorted(b) for o, b in state.kept_buffers.items()} == {"a": ["0", "2"]}
    keep("b", {"0": buf("cuda")})  # a new sender: the old one's memory is let go
    assert list(state.kept_buffers) == ["b"]
    keep("b", {}, drop=True)
    assert state.kept_buffers == {}


def test_a_repeat_of_the_cached_layout_reuses_its_views_and_another_layout_does_not(params_b):
    """Same owner, keys, memory and entries: the checked views of last time; anything else is parsed anew."""
    import base64

    from agentrl.engine.weight_loading import FlatLayoutCache, deserialize_flat_buckets, flat_buckets_body

    flat = torch.cat([t.reshape(-1) for t in params_b.values()])
    entries, offset = [], 0
    for name, t in params_b.items():
        entries.append((name, tuple(t.shape), offset, t.numel()))
        offset += t.numel()

    def payload(entries, owner="o", key="k0"):
        return flat_buckets_body([(key, flat, entries)], owner=owner)["serialized_named_tensors"][0]

    cache = FlatLayoutCache()
    first = deserialize_flat_buckets(payload(entries), cache)
    assert cache.get(first.layout) is None  # nothing is cached until the caller puts it (after checking)
    cache.put(first)
    assert cache.owner == "o"
    again = deserialize_flat_buckets(payload(entries), cache)
    assert again.tensors is first.tensors and again.layout == first.layout
    for other in (payload(entries[:-1]), payload(entries, owner="p"), payload(entries, key="k1")):
        fresh = deserialize_flat_buckets(other, cache)
        assert fresh.tensors is not first.tensors
    unkeyed = flat_buckets_body([(None, flat, entries)], owner="o")["serialized_named_tensors"][0]
    assert deserialize_flat_buckets(base64.b64decode(unkeyed), cache).layout is None  # fresh memory: never cached
    cache.clear()
    assert deserialize_flat_buckets(payload(entries), cache).tensors is not first.tensors


def test_copy_plan_writes_the_live_parameters_bitwise_even_after_their_data_is_swapped():
    from agentrl.engine.weight_loading import CopyPlan

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    sources = {"weight": torch.randn(3, 4), "bias": torch.randn(3, dtype=torch.float64)}  # bias: another dtype
    plan = CopyPlan(model.state_dict(keep_vars=True), sources)
    plan()
    assert torch.equal(model.weight, sources["weight"]) and torch.equal(model.bias, sources["bias"].float())
    model.weight.data = torch.empty(0)  # what releasing memory does
    assert not plan.still_fits()
    model.weight.data = torch.zeros(3, 4)  # and resuming it
    assert plan.still_fits()
    plan()
    assert torch.equal(model.weight, sources["weight"])  # the new storage was written, not the old one


def test_rank_0s_rendezvous_store_holds_the_port_it_announces():
    """The port is the store's from its bind: no window in which another process can take it first
    (a free port picked beforehand lost that race in a CI run: EADDRINUSE)."""
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    from agentrl.engine.weight_group import listening_store

    store = listening_store("127.0.0.1", world_size=2, timeout=timedelta(seconds=10))
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))
    client = TCPStore("127.0.0.1", store.port, 2, False, timeout=timedelta(seconds=10))
    store.set("k", "v")
    assert client.get("k") == b"v"
