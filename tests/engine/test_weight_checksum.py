"""Weight files sent to an engine carry a checksum manifest it verifies before loading: a flipped byte, a
truncated, missing or unlisted file is a 400 naming the file, and the engine keeps its old weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentrl.engine.weight_loading import CHECKSUM_MANIFEST
from agentrl.weights.transports.disk import save_safetensors


@pytest.fixture()
def sent(tiny_model_b, tmp_path) -> Path:
    """Model B's tensors as DiskTransport writes them (shards + manifest)."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(Path(tiny_model_b).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out = tmp_path / "v-1"
    save_safetensors(list(tensors.items()), out, shard_bytes=1 << 20)  # several shards
    return out


def state(client) -> dict:
    return client.get("/weights_checksum").json()


def load(client, path: Path, version: str = "B", **extra):
    return client.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": version, **extra})


def reset(client, tiny_model) -> dict:
    """Model A (an HF directory without a manifest, loaded unchecked on purpose) and its checksum."""
    assert load(client, tiny_model, "A", allow_missing_manifest=True).status_code == 200
    return state(client)


def shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def test_intact_files_load(client, tiny_model, sent):
    reset(client, tiny_model)
    manifest = json.loads((sent / CHECKSUM_MANIFEST).read_text())
    assert sorted(manifest["files"]) == [f.name for f in shards(sent)] and len(manifest["files"]) > 1
    r = load(client, sent)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert state(client)["weight_version"] == "B"


def flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) - 9] ^= 0x10  # inside tensor data: safetensors itself would load it silently
    f.write_bytes(bytes(data))


def truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:-100])


@pytest.mark.parametrize(("damage", "needle"), [
    (lambda d: flip(shards(d)[-1]), "fails its checksum"),
    (lambda d: truncate(shards(d)[0]), "truncated"),
    (lambda d: shards(d)[0].unlink(), "missing"),
    (lambda d: shutil.copy(shards(d)[0], d / "model-extra.safetensors"), "not listed"),
    (lambda d: (d / CHECKSUM_MANIFEST).write_text("{"), "not a valid checksum manifest"),
])
def test_damaged_files_are_a_400_naming_the_file_and_keep_old_weights(client, tiny_model, sent, damage, needle):
    before = reset(client, tiny_model)
    damage(sent)
    r = load(client, sent)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert needle in r.json()["message"] and str(sent) in r.json()["message"]
    assert state(client) == before


def test_truncated_file_without_manifest_is_a_400_not_a_500(client, tiny_model, tmp_path):
    before = reset(client, tiny_model)
    plain = tmp_path / "hf"
    shutil.copytree(tiny_model, plain)
    (target,) = shards(plain)
    truncate(target)
    r = load(client, plain, allow_missing_manifest=True)
    assert r.status_code == 400 and target.name in r.json()["message"], r.text
    assert state(client) == before


def test_flipped_bytes_without_manifest_are_refused_unless_said_on_purpose(client, tiny_model, sent):
    before = reset(client, tiny_model)
    (sent / CHECKSUM_MANIFEST).unlink()
    flip(shards(sent)[-1])  # safetensors alone loads these bytes without a word
    r = load(client, sent)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert CHECKSUM_MANIFEST in r.json()["message"] and "allow_missing_manifest" in r.json()["message"]
    assert state(client) == before
    r = load(client, sent, allow_missing_manifest=True)  # the caller's explicit choice: loaded unchecked
    assert r.status_code == 200 and r.json()["success"], r.text
    assert state(client)["weight_version"] == "B" and state(client)["total"] != before["total"]


@pytest.mark.parametrize("flag", ["yes", 1, None, [True]])
def test_a_manifest_flag_that_is_not_a_bool_is_a_400(client, tiny_model, sent, flag):
    before = reset(client, tiny_model)
    r = load(client, sent, allow_missing_manifest=flag)
    assert r.status_code == 400 and "allow_missing_manifest" in r.json()["error"]["message"], r.text
    assert state(client) == before

