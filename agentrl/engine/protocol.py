"""Request bodies of the SGLang native API (0.5.23) as the embedded engine accepts them.

Unknown fields: SGLang's ``GenerateReqInput`` has many fields we do not implement (LoRA, multimodal,
disaggregation, ...). A field SGLang knows is accepted and ignored when it carries its default (the smg
router re-serialises bodies and may send them as ``null``), and rejected with 400 when it asks for a
feature we lack. A name SGLang does not know is rejected with 400 naming it: a typo such as
``max_tokens`` must not silently fall back to a default. The same holds inside ``sampling_params``.

:func:`context_length_of` reads the limit a request's prompt plus reply must fit, from the model directory.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# config.json keys that hold the context length, by model family (Llama/Qwen, MPT, Qwen-1 / ChatGLM).
_CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "max_seq_len", "seq_length")


def context_length_of(model_dir: str | Path) -> int | None:
    """The model's context length from its HF ``config.json``, or ``None`` if the config does not say."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for key in _CONTEXT_LENGTH_KEYS:
        if isinstance(config.get(key), int):
            return config[key]
    return None


def routes_experts(model_dir: str | Path) -> bool:
    """Whether the embedded engine reports routing (``return_routed_experts``) for this model: a Qwen3-MoE."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("model_type") == "qwen3_moe" and bool(config.get("num_experts") or config.get("num_local_experts"))


class BadRequest(ValueError):
    """A request the engine refuses; the message is returned to the client with ``status``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# Top-level GenerateReqInput fields of SGLang that we accept but do not implement (ignored when "empty").
_IGNORED_GENERATE_FIELDS = {
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
    "return_hidden_states", "lora_path", "lora_id", "session_params", "custom_logit_processor",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "data_parallel_rank",
    "log_metrics", "modalities", "image_data", "video_data", "audio_data", "input_embeds",
    "background", "priority", "extra_key", "routed_dp_rank", "no_logs", "custom_labels",
    "return_bytes", "return_entropy", "conversation_id", "label", "routing_key", "stream_options",
    "received_time", "is_single", "validation_time", "model", "text_input",
}
_GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "stream", "rid", "return_routed_experts"}

_SAMPLING_FIELDS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
    "n", "sampling_seed", "skip_special_tokens", "no_stop_trim",
}
# SamplingParams fields of SGLang we accept and ignore when they hold their default value.
_IGNORED_SAMPLING_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "min_new_tokens": (0, None),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "spaces_between_special_tokens": (True, None),
    "regex": (None,),
    "json_schema": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "custom_params": (None,),
    "stream_interval": (None,),
    "logit_bias": (None, {}),
    "stop_regex": (None, [], ""),
}


# Integers go into int64 tensors and torch's seeding; floats must be finite and normal (a subnormal
# temperature divides logits into inf and NaN).
_INT64_MAX = 2**63 - 1
# Below this a temperature turns float32 logits into overflow; SGLang treats such values as greedy, we ask
# for an explicit 0 so the returned log-probs mean what the client thinks.
MIN_TEMPERATURE = 1e-6


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == -1 or value in ((), [], {}, "") or value == 0


@dataclass
class SamplingParams:
    """Validated sampling parameters of one request (defaults as SGLang's)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def parse(cls, raw: Any) -> SamplingParams:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise BadRequest(f"sampling_params must be a JSON object, got {type(raw).__name__}")
        unknown = sorted(k for k in raw if k not in _SAMPLING_FIELDS and k not in _IGNORED_SAMPLING_DEFAULTS)
        if unknown:
            raise BadRequest(f"unknown sampling_params field(s): {', '.join(unknown)}")
        for key, defaults in _IGNORED_SAMPLING_DEFAULTS.items():
            if isinstance(raw.get(key), float) and not math.isfinite(raw[key]):
                raise BadRequest(f"sampling_params.{key} must be a finite number, got {raw[key]!r}")
            if key in raw and raw[key] not in defaults:
                raise BadRequest(f"sampling_params.{key}={raw[key]!r} is not supported by the embedded engine")
        out = cls()
        vals = {k: v for k, v in raw.items() if k in _SAMPLING_FIELDS and v is not None}
        if "max_new_tokens" in vals:
            out.max_new_tokens = _int(vals["max_new_tokens"], "max_new_tokens")
            if out.max_new_tokens <= 0:
                raise BadRequest(f"sampling_params.max_new_tokens must be >= 1, got {out.max_new_tokens}")
        if "temperature" in vals:
            out.temperature = _float(vals["temperature"], "temperature")
            if out.temperature < 0 or 0 < out.temperature < MIN_TEMPERATURE:
                raise BadRequest(f"sampling_params.temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                                 f"got {out.temperature!r}")
        if "top_p" in vals:
            out.top_p = _float(vals["top_p"], "top_p")
            if not 0.0 < out.top_p <= 1.0:
                raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {out.top_p}")
        if "top_k" in vals:
            out.top_k = _int(vals["top_k"], "top_k")
            if out.top_k < -1:
                raise BadRequest(f"sampling_params.top_k must be -1 (off) or >= 0, got {out.top_k}")
        if "min_p" in vals:
            out.min_p = _float(vals["min_p"], "min_p")
            if not 0.0 <= out.min_p <= 1.0:
                raise BadRequest(f"sampling_params.min_p must be in [0, 1], got {out.min_p}")
        if "stop" in vals:
            stop = vals["stop"]
            stop = [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
                raise BadRequest("sampling_params.stop must be a non-empty string or a list of them")
            out.stop = stop
        if "stop_token_ids" in vals:
            ids = vals["stop_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise BadRequest("sampling_params.stop_token_ids must be a list of integers")
            out.stop_token_ids = ids
        if "ignore_eos" in vals:
            out.ignore_eos = _bool(vals["ignore_eos"], "ignore_eos")
        if "n" in vals:
            out.n = _int(vals["n"], "n")
            if not 1 <= out.n <= 256:
                raise BadRequest(f"sampling_params.n must be in [1, 256], got {out.n}")
        if "sampling_seed" in vals:
            out.sampling_seed = _int(vals["sampling_seed"], "sampling_seed")
            if out.sampling_seed < 0:  # n > 1 seeds seed + i: with seed <= 2**63-1 that stays a valid torch seed
                raise BadRequest(f"sampling_params.sampling_seed must be in [0, 2**63), got {out.sampling_seed}")
        if "skip_special_tokens" in vals:
            out.skip_special_tokens = _bool(vals["skip_special_tokens"], "skip_special_tokens")
        if "no_stop_trim" in vals:
            out.no_stop_trim = _bool(vals["no_stop_trim"], "no_stop_trim")
        return out


def _int(value: Any, name: str) -> int:
    integral = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if isinstance(value, bool) or not integral:
        raise BadRequest(f"sampling_params.{name} must be an integer, got {_brief(value)}")
    if not -_INT64_MAX <= value <= _INT64_MAX:
        raise BadRequest(f"sampling_params.{name} is out of range (|value| < 2**63), got {_brief(value)}")
    return int(value)


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"sampling_params.{name} must be a number, got {_brief(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        number = math.inf
    if not math.isfinite(number):
        raise BadRequest(f"sampling_params.{name} must be a finite number, got {_brief(value)}")
    if 0 < abs(number) < sys.float_info.min:
        raise BadRequest(f"sampling_params.{name} is subnormal ({_brief(value)}): too small to compute with")
    return number


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"sampling_params.{name} must be true or false, got {value!r}")
    return value


@dataclass
class GenerateRequest:
    """A validated ``/generate`` body: one or several prompts (``batched`` = the body held a list)."""

    prompts: list[list[int] | str]
    batched: bool
    sampling: list[SamplingParams]
    return_logprob: bool
    stream: bool
    rids: list[str | None]
    return_routed_experts: bool = False  # MoE: meta_info.routed_experts, the experts chosen for each output token

    @classmethod
    def parse(cls, body: Any) -> GenerateRequest:
        if not isinstance(body, dict):
            raise BadRequest("the /generate body must be a JSON object")
        unknown = sorted(k for k in body if k not in _GENERATE_FIELDS and k not in _IGNORED_GENERATE_FIELDS)
        if unknown:
            raise BadRequest(f"unknown /generate field(s): {', '.join(unknown)}")
        for key in _IGNORED_GENERATE_FIELDS & body.keys():
            if not _is_empty(body[key]) and key not in {"received_time", "validation_time", "is_single", "model"}:
                if key in {"log_metrics", "no_logs", "background"} or key.startswith("bootstrap"):
                    continue  # operational hints, harmless to ignore
                raise BadRequest(f"/generate field {key!r} is not supported by the embedded engine")
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise BadRequest("give exactly one of 'text' or 'input_ids'")
        if text is not None:
            batched = isinstance(text, list)
            prompts: list = list(text) if batched else [text]
            if not all(isinstance(t, str) for t in prompts):
                raise BadRequest("'text' must be a string or a list of strings")
            if not prompts or any(t == "" for t in prompts):
                raise BadRequest("empty prompt: 'text' must not be empty")
        else:
            if not isinstance(input_ids, list) or not input_ids:
                raise BadRequest("empty prompt: 'input_ids' must be a non-empty list of token ids")
            batched = isinstance(input_ids[0], list)
            prompts = list(input_ids) if batched else [input_ids]
            for ids in prompts:
                if not isinstance(ids, list) or not ids:
                    raise BadRequest("empty prompt: each 'input_ids' entry must be a non-empty list")
                if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise BadRequest("'input_ids' must hold integers only")
        raw_sp = body.get("sampling_params")
        if isinstance(raw_sp, list):
            if len(raw_sp) != len(prompts):
                raise BadRequest(f"{len(raw_sp)} sampling_params for {len(prompts)} prompts")
            sampling = [SamplingParams.parse(sp) for sp in raw_sp]
        else:
            sampling = [SamplingParams.parse(raw_sp)] * len(prompts)
        rid = body.get("rid")
        if rid is None:
            rids: list[str | None] = [None] * len(prompts)
        elif isinstance(rid, str):
            rids = [rid] if not batched else [f"{rid}-{i}" for i in range(len(prompts))]
        elif isinstance(rid, list) and len(rid) == len(prompts) and all(isinstance(r, str) for r in rid):
            rids = list(rid)
        else:
            raise BadRequest("'rid' must be a string, or a list of strings with one per prompt")
        return_logprob = body.get("return_logprob") or False
        if isinstance(return_logprob, list):
            return_logprob = any(return_logprob)
        stream = body.get("stream") or False
        if not isinstance(return_logprob, bool) or not isinstance(stream, bool):
            raise BadRequest("'return_logprob' and 'stream' must be true or false")
        if stream and (batched or any(sp.n > 1 for sp in sampling)):
            raise BadRequest("stream=true supports one prompt with n=1")
        routed = body.get("return_routed_experts") or False
        if not isinstance(routed, bool):
            raise BadRequest("'return_routed_experts' must be true or false")
        return cls(prompts, batched, sampling, return_logprob, stream, rids, routed)
