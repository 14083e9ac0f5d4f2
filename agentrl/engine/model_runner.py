"""The transformers model and its two forward passes: prefill of one sequence and a batched decode step.

KV layout: a running batch keeps, per layer, keys/values ``[B, kv_heads, T, head_dim]`` with each row's
real tokens in its last ``length`` columns (left padding). Every row gets exactly one token per decode
step, so padding stays on the left; positions are passed explicitly, so padding never shifts RoPE.

Two holders of that layout. :class:`BatchKV` (the default): tensors exactly as wide as the batch, rebuilt
when rows join or leave. :class:`StaticBatchKV` (``ModelRunner(static_kv=True)``, the default on CUDA):
fixed ``[rows, kv_heads, columns, head_dim]`` buffers whose row ``i`` holds its tokens in the columns just
before ``width`` (the column every row's next token goes to); attention runs over all columns with a
mask. Fixed shapes and addresses let each decode batch size (rounded up to a bucket) be one captured CUDA
graph: a step is then a replay instead of hundreds of Python-launched kernels.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from agentrl.engine.prefix_cache import KV


@dataclass
class BatchKV:
    """Left-padded KV of the running batch (see module docstring), held in a transformers cache object
    that decode steps grow in place; it is rebuilt only when rows join or leave."""

    cache: Any  # transformers DynamicCache, or None when the batch is empty
    lengths: list[int]

    @classmethod
    def empty(cls) -> BatchKV:
        return cls(None, [])

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [] if self.cache is None else [(la.keys, la.values) for la in self.cache.layers]

    @property
    def width(self) -> int:
        return self.cache.layers[0].keys.shape[2] if self.cache is not None else 0

    def row(self, i: int) -> KV:
        """Row ``i``'s real KV, as an independent copy ``[(k, v)]`` with ``[kv_heads, L, head_dim]``."""
        n, t = self.lengths[i], self.width
        return [(k[i, :, t - n :].clone(), v[i, :, t - n :].clone()) for k, v in self.layers]

    def select(self, rows: list[int]) -> BatchKV:
        """Keep ``rows`` (in that order) and trim columns that are now padding in every row."""
        import torch

        if not rows:
            return BatchKV.empty()
        lengths = [self.lengths[i] for i in rows]
        start = self.width - max(lengths)
        idx = torch.tensor(rows, device=self.layers[0][0].device)
        layers = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:]) for k, v in self.layers]
        return BatchKV(_make_cache(layers), lengths)

    def extend(self, kvs: list[KV]) -> BatchKV:
        """Add sequences' KV as new last rows, left-padding everything to the widest."""
        import torch

        if not kvs:
            return self
        lengths = [*self.lengths, *(kv[0][0].shape[1] for kv in kvs)]
        width = max(lengths)
        old = self.layers
        layers = []
        for li in range(len(kvs[0])):
            parts_k = [_pad_left(old[li][0], width)] if old else []
            parts_v = [_pad_left(old[li][1], width)] if old else []
            parts_k += [_pad_left(kv[li][0].unsqueeze(0), width) for kv in kvs]
            parts_v += [_pad_left(kv[li][1].unsqueeze(0), width) for kv in kvs]
            layers.append((torch.cat(parts_k, dim=0), torch.cat(parts_v, dim=0)))
        return BatchKV(_make_cache(layers), lengths)


_GENERATIONS = itertools.count(1)  # buffer generations, unique across batches: graphs are keyed by them
DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def decode_bucket(n: int) -> int:
    """The captured batch size a decode step of ``n`` rows runs at (rows past ``n`` are idle)."""
    return next((b for b in DECODE_BUCKETS if b >= n), -(-n // 64) * 64)


class RowBuffers:
    """Per-layer key and value buffers ``[rows, kv_heads, columns, head_dim]`` whose first ``len(lengths)``
    rows are the running batch, one sequence per row (:class:`StaticBatchKV`, ``cpu_decode.SlotBatchKV``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: list[int]
    device: Any

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def columns(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def _keep_rows(self, rows: list[int]) -> None:
        """Keep ``rows``, in that order, as the first rows (any order: each buffer is gathered once)."""
        import torch

        if rows != list(range(len(rows))):
            idx = torch.tensor(rows, device=self.device)
            with torch.inference_mode():
                for buf in (*self.keys, *self.values):
                    buf[: len(rows)] = buf.index_select(0, idx)
        self.lengths = [self.lengths[i] for i in rows]


def fill_holes(n: int, rows: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """The row moves that drop ``rows`` from a batch of ``n``: each hole is filled by the last remaining row.
    Returns ``(moves, order)``: ``(from, to)`` pairs, and the old index of every remaining row in its new order."""
    drop = set(rows)
    order = list(range(n))
    moves: list[tuple[int, int]] = []
    for hole in sorted(drop):
        while order and order[-1] in drop:
            order.pop()
        if hole >= len(order):
            break
        moves.append((order.pop(), hole))
        order[hole] = moves[-1][0]
    return moves, order


class StaticBatchKV(RowBuffers):
    """The running batch's KV in fixed buffers (see module docstring); mutated in place.

    Row ``i`` holds its ``lengths[i]`` tokens in columns ``[width - lengths[i], width)``; the next decode step
    writes every row's new token at column ``width``. Columns outside a row's span hold finite leftovers
    (buffers start zeroed; every write is a real K/V), which the mask hides. ``generation`` changes whenever
    the buffers are reallocated, which invalidates graphs captured on the old ones.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, rows: int, columns: int = 1024) -> None:
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.store: torch.Tensor | None = None  # what keys and values are views of (_allocate)
        self.lengths: list[int] = []
        self.width = 0
        self.generation = 0
        self.version = 0  # bumped by every change other than a decode step's (rows, columns, buffers)
        self._initial = (rows, columns)  # allocated when the first rows join: an empty batch holds no memory

    # -- storage ------------------------------------------------------------------------------------
    def _allocate(self, rows: int, columns: int) -> None:
        import torch

        layers, heads, dim = self.shape
        with torch.inference_mode():
            # one allocation [layers, 2, rows, kv_heads, columns, dim]: a row's KV of every layer (a finished row
            # into the prefix cache), a gather of rows or a shift of columns is one kernel, not two per layer
            store = torch.zeros((layers, 2, rows, heads, columns, dim), dtype=self.dtype, device=self.device)
            n, w = len(self.lengths), self.width
            if self.store is not None and n:
                store[:, :, :n, :, :w] = self.store[:, :, :n, :, :w]
        self.store = store
        self.keys, self.values = [store[li, 0] for li in range(layers)], [store[li, 1] for li in range(layers)]
        self.generation = next(_GENERATIONS)
        self.version += 1

    def _move_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy rows ``src`` onto rows ``dst`` (the occupied columns of every layer, in one gather and one
        scatter); ``dst`` rows that are not also sources must hold nothing still needed."""
        import torch

        if not src:
            return
        lo = self.width - max(self.lengths[i] for i in src)
        with torch.inference_mode():
            span = self.store[:, :, :, :, lo : self.width]
            span.index_copy_(2, torch.tensor(dst, device=self.device),
                             span.index_select(2, torch.tensor(src, device=self.device)))

    def _keep_rows(self, rows: list[int]) -> None:
        moved = [(r, i) for i, r in enumerate(rows) if r != i]
        self._move_rows([r for r, _ in moved], [i for _, i in moved])
        self.lengths = [self.lengths[i] for i in rows]

    def remove(self, rows: list[int]) -> list[int]:
        """Drop ``rows``: each hole is filled by the last remaining row (one row copied per hole, not the
        batch, as ``cpu_decode.SlotBatchKV.remove``). Returns the old index of every remaining row, in its new
        order."""
        moves, order = fill_holes(len(self.lengths), rows)
        self._move_rows([s for s, _ in moves], [d for _, d in moves])
        self.lengths = [self.lengths[i] for i in order]
        self.version += 1
        if not order:
            self.width = 0
        return order

    def _shift(self, by: int) -> None:
        """Move every row's tokens ``by`` columns (right if positive); ``width`` follows."""
        import torch

        n, w = len(self.lengths), self.width
        self.version += 1
        if n == 0:
            self.width = 0
            return
        lo = w - max(self.lengths)
        with torch.inference_mode():
            self.store[:, :, :n, :, lo + by : w + by] = self.store[:, :, :n, :, lo:w].clone()
        self.width = w + by

    def reserve(self, rows: int, new_lengths: tuple[int, ...] = ()) -> None:
        """Room for ``rows`` rows and, after rows of ``new_lengths`` join, one more column: columns that are
        padding in every row are dropped first, then the buffers grow (columns to a power of two)."""
        def needed() -> int:
            return max(self.width, *new_lengths) + 1 if new_lengths else self.width + 1

        if needed() > self.columns and self.lengths:
            self._shift(max(self.lengths) - self.width)  # left-compact
        if rows > self.rows or needed() > self.columns:
            first_rows, first_columns = self._initial if not self.keys else (0, 0)
            self._allocate(max(rows, self.rows, first_rows),
                           max(self.columns, first_columns, 1 << (needed() - 1).bit_length()))

    # -- the BatchKV interface ----------------------------------------------------------------------
    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n, w = len(self.lengths), self.width
        return [(k[:n, :, :w], v[:n, :, :w]) for k, v in zip(self.keys, self.values, strict=True)]

    def row(self, i: int) -> KV:
        n, w = self.lengths[i], self.width
        kv = self.store[:, :, i, :, w - n : w].clone()  # [layers, 2, kv_heads, n, dim]: one copy
        return [(kv[li, 0], kv[li, 1]) for li in range(kv.shape[0])]

    def select(self, rows: list[int]) -> StaticBatchKV:
        self._keep_rows(rows)
        self.version += 1
        if not rows:
            self.width = 0
        return self

    def extend(self, kvs: list[KV]) -> StaticBatchKV:
        import torch

        if not kvs:
            return self
        new = [kv[0][0].shape[1] for kv in kvs]
        self.reserve(len(self.lengths) + len(kvs), tuple(new))
        width = max(self.width, *new)
        if not self.lengths:
            self.width = width
        elif width > self.width:
            self._shift(width - self.width)
        n = len(self.lengths)
        block = getattr(kvs, "block", None)
        with torch.inference_mode():
            if block is not None:  # every row right-aligned in one padded block: one copy per layer
                b, cols = len(kvs), block[0][0].shape[2]
                for li, (k, v) in enumerate(block):
                    self.keys[li][n : n + b, :, width - cols : width] = k
                    self.values[li][n : n + b, :, width - cols : width] = v
            else:
                for j, kv in enumerate(kvs):
                    for li, (k, v) in enumerate(kv):
                        self.keys[li][n + j, :, width - new[j] : width] = k
                        self.values[li][n + j, :, width - new[j] : width] = v
        self.lengths = [*self.lengths, *new]
        self.version += 1
        return self


class PrefillKV(list):
    """Each prefilled sequence's KV (a ``list`` of :data:`KV`, views into the prefill's padded cache) and,
    when no sequence had a cached past, that padded cache itself (``block``: per layer ``(k, v)``
    ``[B, kv_heads, N, head_dim]``, row ``b``'s tokens in its last columns): :meth:`StaticBatchKV.extend`
    then copies each layer in one go instead of one copy per row and layer. Columns left of a row's
    tokens hold its padding queries' finite K/V, which the decode mask hides."""

    block: list[tuple[torch.Tensor, torch.Tensor]] | None = None


def _static_cache(keys: list[torch.Tensor], values: list[torch.Tensor], column: torch.Tensor):
    """A transformers cache whose layers write the step's K/V at ``column`` (a device tensor) of fixed buffers
    and hand attention the whole buffers (the mask hides what is not a row's own)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layers = [_static_layer_class()(k, v, column) for k, v in zip(keys, values, strict=True)]
    return cache


@functools.cache
def _static_layer_class():
    from transformers.cache_utils import DynamicLayer

    class StaticColumnLayer(DynamicLayer):
        def __init__(self, keys, values, column) -> None:
            super().__init__()
            self.keys, self.values, self._column = keys, values, column
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys.index_copy_(2, self._column, key_states)
            self.values.index_copy_(2, self._column, value_states)
            return self.keys, self.values

    return StaticColumnLayer


def _make_cache(layers: list[tuple[torch.Tensor, torch.Tensor]]):
    """A transformers DynamicCache over ``layers`` whose layers append into spare capacity."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if layers:
        cache.layers = [_growing_layer(k, v) for k, v in layers]
    return cache


def _growing_layer(keys: torch.Tensor, values: torch.Tensor, spare: int = 64):
    return _growing_layer_class()(keys, values, spare)


@functools.cache
def _growing_layer_class():
    """A ``DynamicLayer`` that writes new tokens into spare capacity (doubling when full) instead of
    re-allocating the whole KV with ``torch.cat`` on every decode step (built lazily: transformers is
    imported only when a model runs)."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def __init__(self, keys, values, spare: int) -> None:
            super().__init__()
            b, h, t, d = keys.shape
            self._k = keys.new_empty((b, h, t + spare, d))
            self._v = values.new_empty((b, h, t + spare, d))
            self._k[:, :, :t] = keys
            self._v[:, :, :t] = values
            self._len = t
            self.keys, self.values = self._k[:, :, :t], self._v[:, :, :t]
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            end = self._len + key_states.shape[-2]
            if end > self._k.shape[2]:
                cap = max(end, 2 * self._k.shape[2])
                k, v = self._k, self._v
                self._k = k.new_empty((*k.shape[:2], cap, k.shape[3]))
                self._v = v.new_empty((*v.shape[:2], cap, v.shape[3]))
                self._k[:, :, : self._len] = k[:, :, : self._len]
                self._v[:, :, : self._len] = v[:, :, : self._len]
            self._k[:, :, self._len : end] = key_states
            self._v[:, :, self._len : end] = value_states
            self._len = end
            self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
            return self.keys, self.values

    return GrowingLayer


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    import torch

    missing = width - t.shape[2]
    if missing == 0:
        return t
    pad = torch.zeros((t.shape[0], t.shape[1], missing, t.shape[3]), dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=2)


# ModelRunner.stats, counters since start (Scheduler.stats reads them): graph captures and their seconds, decode
# steps replayed / run eagerly, host writes of a captured step's inputs, seconds waiting in collect, prefills
RUNNER_STATS = ("captures", "capture_s", "graph_steps", "eager_steps", "input_writes", "wait_s", "prefills",
                "fused_prefills")


def resolve_dtype(name: str):
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(table)}")
    return table[name]


class ModelRunner:
    """Loads a causal LM + tokenizer from a local directory and runs its forward passes."""

    def __init__(
        self, model_path: str, *, dtype: str = "float32", device: str | None = None, memory_saver: bool = False,
        static_kv: bool | None = None, cuda_graphs: bool | None = None, fused_ops: bool | None = None,
    ) -> None:
        """``static_kv``: hold the running batch in :class:`StaticBatchKV` (default: on CUDA); ``cuda_graphs``:
        replay captured decode steps (default: with ``static_kv`` on CUDA; a capture that fails falls back to
        running the step eagerly, logged once); ``fused_ops``: compiled RMSNorm, rotary embedding and SiLU
        gate in place of transformers' (``fused_ops.py``; default: on CUDA, kept only if its check passes), and
        on CUDA the engine's own decode step and prefill for Qwen2/Llama-shaped models (``fused_decoder.py``,
        likewise checked; it joins each layer's q/k/v and gate/up weights into one buffer)."""
        import contextlib

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        region = contextlib.nullcontext()
        if memory_saver and self.device.type == "cuda":
            # weights allocated inside the region can be paused/resumed by tag (see memory.py)
            with contextlib.suppress(ImportError):
                from torch_memory_saver import torch_memory_saver  # type: ignore[import-not-found]

                region = torch_memory_saver.region(tag="weights", enable_cpu_backup=True)
        from agentrl.engine.attention import register

        fused = bool(fused_ops or (fused_ops is None and self.device.type == "cuda"))
        with region:
            # SDPA, with decode steps of grouped-query models on the KV heads as they are (attention.py)
            self.model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=self.dtype, attn_implementation=register()
            ).to(self.device)
            if fused and self.device.type == "cuda":
                from agentrl.engine.fused_decoder import join_projections, unsupported_reason

                if unsupported_reason(self.model) is None:  # the joined buffers are weights: in the region too
                    join_projections(self.model)
            from agentrl.engine import moe

            self.moe_layers = moe.install(self.model)  # MoE blocks that report their routing (0: dense)
        self.model.eval()
        config = self.model.config
        self.context_length: int = int(getattr(config, "max_position_embeddings", 2048))
        self.vocab_size: int = int(self.model.get_input_embeddings().weight.shape[0])
        self.eos_token_ids: set[int] = _eos_ids(self.model, self.tokenizer)
        # transformers >= 5.2x renamed ``past_key_values`` to ``cache``; accept both
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.fused_decoder = None  # fused_decoder.FusedDecoder: decode steps (and new prefills) in fewer kernels
        self.fused_prefill = False
        if fused and self.device.type == "cuda":
            from agentrl.engine.fused_decoder import build

            self.fused_decoder, self.fused_prefill = build(self.model, self.context_length, self._cache_arg)
        self.fused_ops = self._install_fused_ops() if fused else False
        self.triton_attention = self.device.type == "cuda" and self.fused_ops and self._check_decode_attention()
        on_cuda = self.device.type == "cuda"
        self.static_kv = on_cuda if static_kv is None else static_kv
        self.cuda_graphs = bool(self.static_kv and on_cuda and (True if cuda_graphs is None else cuda_graphs))
        self.static_rows = 64  # initial buffer rows; the engine sets its max batch size
        self._graphs: dict[tuple[int, int], Any] = {}  # (bucket, buffer generation) -> captured step
        self._graph_pool = None
        # Warm-ups and captures run on this one stream. cuBLAS keeps a workspace per (handle, stream), made on
        # the stream's first matmul: made inside a capture it would live in the graph pool, which dropping
        # the graphs (release, weights moved) frees under it; made by the eager warm-up it lives on.
        self._capture_stream: Any = None
        self._graph_failed = False
        # Unseeded rows' uniforms outside a captured step: None is torch's default generator. A failed
        # capture leaves that generator marked as capturing, and every later draw from it raises ("Offset
        # increment outside graph capture"), so the runner then draws from a generator of its own.
        self.sampling_rng: Any = None
        self._weights_key: tuple[int, ...] = (0, 0)
        self._param_list: list[Any] | None = None
        # decode steps on CUDA graphs draw their tokens inside the graph (decode_sample)
        self.fused_sampling = not self.moe_layers  # MoE: each step's routing is read before the next one runs
        self._routed_rows: list[int] = []  # flat token positions of the last forward whose logits were returned
        self._rows_key: tuple | None = None  # launch_sample's rows, and their (fusable, temperatures, greedy)
        self._rows_sampling: tuple = (False, [], [])
        self.stats: dict[str, float] = dict.fromkeys(RUNNER_STATS, 0)

    def _install_fused_ops(self) -> bool:
        """Patch in the compiled ops, checked against this model's own eager logits at the shapes a run
        meets (batch and length of 1 or more: sizes of 1 compile apart), so that compiling happens here."""
        import torch

        from agentrl.engine import fused_ops

        vocab = int(self.model.get_input_embeddings().weight.shape[0])
        gen = torch.Generator(device="cpu").manual_seed(0)
        shapes = [(2, 8), (1, 8), (1, 1), (2, 1)]
        inputs = [torch.randint(3, vocab, shape, generator=gen).to(self.device) for shape in shapes]
        with torch.inference_mode():
            refs = [self.model(input_ids=ids).logits.float() for ids in inputs]
        tol = 1e-4 if self.dtype == torch.float32 else 3e-2  # relative: summation order / bf16 rounding

        def check() -> None:
            with torch.inference_mode(), fused_ops.active():
                for ids, ref in zip(inputs, refs, strict=True):
                    out = self.model(input_ids=ids).logits.float()
                    err = ((out - ref).norm() / ref.norm()).item()
                    if not err < tol:
                        raise RuntimeError(f"fused ops: relative error {err:.2e} at shape {tuple(ids.shape)}")
                # the decode step's sampler at one row and at several: greedy rows the argmax, every row the
                # log-prob of its token at its temperature
                for rows in (1, 3):
                    logits = (3 * torch.randn((rows, vocab), generator=gen)).to(self.device, self.dtype)
                    temps = torch.tensor([1.0, 0.7, 1.3][:rows], device=self.device)
                    greedy = torch.tensor([True, False, False][:rows], device=self.device)
                    chosen, lp = fused_ops.kernels()["sample"](logits, temps, greedy, torch.rand(logits.shape, device=self.device))
                    want = torch.log_softmax(logits.float() / temps.unsqueeze(1), -1)
                    if int(chosen[0]) != int(logits[0].float().argmax()) or not torch.allclose(
                            lp, want.gather(1, chosen.unsqueeze(1)).squeeze(1), atol=1e-5, rtol=0):
                        raise RuntimeError("fused ops: the compiled sampler disagrees with log_softmax")

        return fused_ops.install(self.model, check)

    def _check_decode_attention(self) -> bool:
        """Turn on ``decode_attention``'s Triton kernel for one-token decode steps if it matches SDPA on this
        model's head layout and dtype (at one row and at several, a left-padded mask, columns not a multiple
        of its tile); else decode keeps SDPA."""
        import logging

        import torch

        from agentrl.engine import attention

        if attention.TRITON_DECODE:
            return True
        cfg = self.model.config
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        tol = 1e-5 if self.dtype == torch.float32 else 2e-2  # relative; bf16: P rounded to bf16, as in SDPA
        try:
            from agentrl.engine.decode_attention import decode_attention, supported

            gen = torch.Generator(device=self.device).manual_seed(0)
            for rows, columns in ((1, 1024), (3, 200), (130, 64)):
                q = torch.randn((rows, kv_heads, heads // kv_heads, dim), device=self.device, dtype=self.dtype, generator=gen)
                k, v = (torch.randn((rows, kv_heads, columns, dim), device=self.device, dtype=self.dtype, generator=gen)
                        for _ in range(2))
                allowed = torch.ones((rows, columns), dtype=torch.bool, device=self.device)
                allowed[0, : columns // 2] = False
                mask = torch.where(allowed, 0.0, torch.finfo(self.dtype).min).to(self.dtype)
                if not supported(q, k, v, mask):
                    return False
                out = decode_attention(q, k, v, mask, dim**-0.5).float()
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), attn_mask=mask.float()[:, None, None, :], scale=dim**-0.5)
                err = ((out - ref).norm() / ref.norm()).item()
                if not err < tol:
                    raise RuntimeError(f"decode attention: relative error {err:.2e} at {rows} rows, {columns} columns")
        except Exception:  # noqa: BLE001 - SDPA is correct, only slower
            logging.getLogger(__name__).exception("Triton decode attention failed its check; decoding with SDPA")
            return False
        attention.TRITON_DECODE = True
        return True

    def _forward_context(self):
        import contextlib

        if not self.fused_ops:
            return contextlib.nullcontext()
        from agentrl.engine import fused_ops

        return fused_ops.active()

    def release_static(self) -> None:
        """Drop the captured decode steps (and with them the last references to old KV buffers)."""
        self._graphs.clear()
        self._graph_pool = None
        if self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def empty_batch(self) -> BatchKV | StaticBatchKV:
        """A batch with no rows, of the kind this runner decodes."""
        if not self.static_kv:
            return BatchKV.empty()
        cfg = self.model.config
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        return StaticBatchKV(int(cfg.num_hidden_layers), heads, dim, self.dtype, self.device, self.static_rows)

    # ---- forward passes -------------------------------------------------------------------------
    def prefill(self, items: list[tuple[list[int], KV | None]]) -> tuple[torch.Tensor, list[KV]]:
        """Run several sequences at once, each ``(tokens, past)`` computing ``tokens[len(past):]`` on top
        of its cached prefix; return last-position logits [B, V] and each sequence's full KV.

        Rows are left-padded twice (before the past and before the new tokens) and a 4D mask lets each
        real token see exactly its own earlier tokens; a padding query sees only itself, which keeps its
        (discarded) activations finite.
        """
        import torch

        pasts = [past[0][0].shape[1] if past else 0 for _, past in items]
        self.stats["prefills"] += 1
        if self.fused_prefill and not any(pasts):
            self.stats["fused_prefills"] += 1
            return self._fused_prefill([tokens for tokens, _ in items])
        news = [len(tokens) - p for (tokens, _), p in zip(items, pasts, strict=True)]
        B, P, N = len(items), max(pasts), max(news)
        dev = self.device
        ids = torch.zeros((B, N), dtype=torch.long, device=dev)
        positions = torch.zeros((B, N), dtype=torch.long, device=dev)
        for b, ((tokens, _), p, n) in enumerate(zip(items, pasts, news, strict=True)):
            ids[b, N - n :] = torch.tensor(tokens[p:], device=dev)
            positions[b, N - n :] = torch.arange(p, p + n, device=dev)
        past_t = torch.tensor(pasts, device=dev).unsqueeze(1)
        new_t = torch.tensor(news, device=dev).unsqueeze(1)
        cols = torch.arange(P + N, device=dev).unsqueeze(0)
        real_key = ((cols < P) & (cols >= P - past_t)) | ((cols >= P) & (cols >= P + N - new_t))  # [B, P+N]
        q_cols = P + torch.arange(N, device=dev)  # column index of each query
        causal = cols.unsqueeze(1) <= q_cols.view(1, N, 1)  # [1, N, P+N]
        allowed = (real_key.unsqueeze(1) & causal) | (cols.unsqueeze(1) == q_cols.view(1, N, 1))
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=dev).masked_fill(~allowed, torch.finfo(self.dtype).min)
        layers = []
        if P:
            n_layers = len(next(past for _, past in items if past))
            for li in range(n_layers):
                ks = [_pad_left(past[li][0].unsqueeze(0), P) if past else None for _, past in items]
                vs = [_pad_left(past[li][1].unsqueeze(0), P) if past else None for _, past in items]
                ref_k = next(k for k in ks if k is not None)
                ks = [k if k is not None else ref_k.new_zeros(ref_k.shape) for k in ks]
                vs = [v if v is not None else ref_k.new_zeros(ref_k.shape) for v in vs]
                layers.append((torch.cat(ks, dim=0), torch.cat(vs, dim=0)))
        cache = _make_cache(layers)
        with torch.inference_mode(), self._forward_context():
            out = self.model(
                input_ids=ids,
                attention_mask=mask.unsqueeze(1),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: cache},
            )
        kvs = PrefillKV()
        full = [(la.keys, la.values) for la in cache.layers]
        for b, (p, n) in enumerate(zip(pasts, news, strict=True)):
            if p == 0:  # the row's tokens are one span of the padded cache: views, no copies
                kvs.append([(k[b, :, P + N - n :], v[b, :, P + N - n :]) for k, v in full])
            else:
                kvs.append([
                    (torch.cat([k[b, :, P - p : P], k[b, :, P + N - n :]], dim=1),
                     torch.cat([v[b, :, P - p : P], v[b, :, P + N - n :]], dim=1))
                    for k, v in full
                ])
        if P == 0:
            kvs.block = full
        self._routed_rows = list(range(N - 1, B * N, N))
        return out.logits[:, -1], kvs

    def _fused_prefill(self, sequences: list[list[int]]) -> tuple[torch.Tensor, PrefillKV]:
        import torch

        with torch.inference_mode():
            logits, block = self.fused_decoder.prefill(sequences)
        width = block[0][0].shape[2]
        kvs = PrefillKV([(k[b, :, width - len(seq) :], v[b, :, width - len(seq) :]) for k, v in block]
                        for b, seq in enumerate(sequences))
        kvs.block = block
        return logits, kvs

    def decode(self, batch: BatchKV | StaticBatchKV, tokens: list[int]) -> tuple[torch.Tensor, BatchKV | StaticBatchKV]:
        """Feed one token per row; return logits [B, V] and the batch KV (grown in place)."""
        import torch

        if isinstance(batch, StaticBatchKV):
            return self._decode_static(batch, tokens)
        width = batch.width
        lengths = torch.tensor(batch.lengths, device=self.device)
        cols = torch.arange(width + 1, device=self.device)
        # row i's real tokens (and the new one) are its last lengths[i] + 1 columns
        mask = (cols.unsqueeze(0) >= (width - lengths).unsqueeze(1)).long()
        ids = torch.tensor(tokens, device=self.device).unsqueeze(1)
        with torch.inference_mode(), self._forward_context():
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=lengths.unsqueeze(1),
                use_cache=True,
                **{self._cache_arg: batch.cache},
            )
        self._routed_rows = list(range(len(tokens)))
        return out.logits[:, -1], BatchKV(batch.cache, [n + 1 for n in batch.lengths])

    def _decode_static(self, batch: StaticBatchKV, tokens: list[int]) -> tuple[torch.Tensor, StaticBatchKV]:
        import torch

        n = len(tokens)
        bucket = decode_bucket(n)
        batch.reserve(bucket)
        width = batch.width
        lengths = torch.tensor(batch.lengths + [0] * (bucket - n), device=self.device)
        step = self._static_step(batch, bucket)
        with torch.inference_mode():
            step["ids"].copy_(torch.tensor(tokens + [0] * (bucket - n), device=self.device).unsqueeze(1))
            step["positions"].copy_(lengths.unsqueeze(1))
            step["column"].fill_(width)
            if self.fused_decoder is None:  # the fused decoder derives each row's span from positions and column
                cols = torch.arange(batch.columns, device=self.device)
                # row i sees its own span and the new column; idle rows only the new column (finite, discarded)
                allowed = (cols.unsqueeze(0) >= (width - lengths).unsqueeze(1)) & (cols.unsqueeze(0) <= width)
                step["mask"].copy_(torch.where(allowed, 0.0, torch.finfo(self.dtype).min)[:, None, None, :])
        if self.cuda_graphs and not self._graph_failed and step["graph"] is None:
            self._capture(step)  # with this step's inputs in place: its warm-up writes only column ``width``
        with torch.inference_mode():
            if step["graph"] is not None:
                step["graph"].replay()
            else:
                step["run"]()
        self.stats["graph_steps" if step["graph"] is not None else "eager_steps"] += 1
        batch.lengths = [length + 1 for length in batch.lengths]
        batch.width = width + 1
        self._routed_rows = list(range(n))
        return step["logits"][:n], batch

    def decode_sample(self, batch: BatchKV | StaticBatchKV, tokens: list[int], params: list[Any],
                      generators: list[Any]) -> tuple[list[int], list[float]] | None:
        """One decode step with the next token drawn and its log-prob taken inside the captured graph
        (``sampling.sample_next``'s policy: log-prob at the row's temperature, 1 for greedy rows); the
        step's inputs stay on the device between steps (the graph feeds its own tokens back and advances
        positions and the column), so a step is one replay and one device-to-host copy of ``2 x rows``
        numbers. ``None`` where that does not apply (no CUDA graphs, seeded rows, top-k/top-p/min-p
        filters): the caller then runs :meth:`decode` and samples the logits itself. The same as
        :meth:`launch_sample` then :meth:`collect`."""
        handle = self.launch_sample(batch, tokens, params, generators)
        return None if handle is None else self.collect(handle)

    def capture_decode_steps(self, batch: BatchKV | StaticBatchKV) -> int:
        """Capture the fused decode step of every bucket up to the batch's rows now (its buffers allocated
        if still empty), while no row runs, instead of at the first step of each batch size a run meets (a
        capture costs many steps' time, and arrivals over HTTP pass through many sizes). Returns how many
        were captured; 0 where steps are not captured (no CUDA graphs, no fused sampling, rows running)."""
        if not (self.fused_sampling and self.cuda_graphs and not self._graph_failed
                and isinstance(batch, StaticBatchKV)) or batch.lengths:
            return 0
        batch.reserve(decode_bucket(self.static_rows))
        captured = 0
        for bucket in DECODE_BUCKETS:
            if bucket > batch.rows or self._graph_failed:
                break
            step = self._static_step(batch, bucket, fused=True)
            if step["graph"] is None:
                self._write_fused_inputs(step, batch, [], [], [])  # idle rows: they write column 0, holding nothing
                self._capture(step)
                step["state"] = None  # the first real step writes its inputs
                captured += step["graph"] is not None
        return captured

    def launch_sample(self, batch: BatchKV | StaticBatchKV, tokens: list[int], params: list[Any],
                      generators: list[Any]) -> dict[str, Any] | None:
        """The first half of :meth:`decode_sample`: queue the step on the device and return at once (the
        batch's lengths already count its token); :meth:`collect` waits for its tokens. Between the two
        the caller may do host work, but must not change the batch."""
        from agentrl.engine.sampling import fusable

        if not (self.fused_sampling and self.cuda_graphs and not self._graph_failed and isinstance(batch, StaticBatchKV)):
            return None
        n = len(tokens)
        # the rows' sampling, worked out again only when the rows or their parameters change
        rows_key = (id(batch), batch.generation, batch.version, tuple(map(id, params)), tuple(map(id, generators)))
        if self._rows_key != rows_key:
            self._rows_key = rows_key
            self._rows_sampling = (fusable(params, generators, self.vocab_size),
                                   [1.0 if p.greedy else float(p.temperature) for p in params],
                                   [bool(p.greedy) for p in params])
        ok, temps, greedy = self._rows_sampling
        if not ok:
            return None
        bucket = decode_bucket(n)
        batch.reserve(bucket)
        width = batch.width
        step = self._static_step(batch, bucket, fused=True)
        state = (id(batch), batch.generation, batch.version, width, tokens, temps, greedy)
        fresh = step["graph"] is None
        if fresh:
            self._write_fused_inputs(step, batch, tokens, temps, greedy)
            self._capture(step)  # its eager warm-up writes column ``width`` only and advances the inputs
            if step["graph"] is None:  # capture failed: the eager path takes over
                return None
        if fresh or step.get("state") != state:
            self._write_fused_inputs(step, batch, tokens, temps, greedy)
        return self._replay(step, batch, {"rows": n, "temps": temps, "greedy": greedy})

    def launch_next(self, handle: dict[str, Any]) -> dict[str, Any] | None:
        """Queue one more step right behind ``handle``'s (still uncollected) one, on the same rows: the
        captured step feeds back its own tokens, so the host need not know them. ``None`` when that step
        cannot simply continue (the batch changed since, or it needs another column than its buffers hold).
        Tokens it draws for a row that the earlier step finished are the caller's to drop."""
        step, batch = handle["step"], handle["batch"]
        if (step.get("tail") is not handle or batch.generation != handle["generation"]
                or batch.version != handle["version"] or batch.width + 1 > batch.columns):
            return None
        return self._replay(step, batch, {key: handle[key] for key in ("rows", "temps", "greedy")})

    def _replay(self, step: dict[str, Any], batch: StaticBatchKV, handle: dict[str, Any]) -> dict[str, Any]:
        """Replay ``step``'s graph and queue its outputs' copy into a host buffer no uncollected step uses."""
        import torch

        slot = next((i for i in range(len(step["host"])) if i not in step["busy"]), len(step["host"]))
        if slot == len(step["host"]):
            cuda = self.device.type == "cuda"
            step["host"].append(torch.zeros(step["out"].shape, dtype=step["out"].dtype, pin_memory=cuda))
            step["done"].append(torch.cuda.Event() if cuda else None)
        step["busy"].add(slot)
        host, done = step["host"][slot], step["done"][slot]
        self.stats["graph_steps"] += 1
        with torch.inference_mode():
            step["graph"].replay()
            host.copy_(step["out"], non_blocking=done is not None)
            if done is not None:
                done.record()
        batch.lengths = [length + 1 for length in batch.lengths]
        batch.width += 1
        handle.update(step=step, batch=batch, slot=slot, width=batch.width, generation=batch.generation,
                      version=batch.version)
        step["tail"] = handle  # the device's inputs now follow this step, whatever the host last collected
        step["state"] = None
        return handle

    def collect(self, handle: dict[str, Any]) -> tuple[list[int], list[float]]:
        """Wait for a launched step; its tokens and their log-probs."""
        import time

        step, batch, slot = handle["step"], handle["batch"], handle["slot"]
        if step["done"][slot] is not None:
            began = time.perf_counter()
            step["done"][slot].synchronize()
            self.stats["wait_s"] += time.perf_counter() - began
        out = step["host"][slot][:, : handle["rows"]].tolist()
        step["busy"].discard(slot)
        new_tokens = [int(t) for t in out[0]]
        if step.get("tail") is handle:  # no later step queued: the device holds what follows these tokens
            step["state"] = (id(batch), batch.generation, batch.version, handle["width"], new_tokens,
                             handle["temps"], handle["greedy"])
        return new_tokens, out[1]

    def _write_fused_inputs(self, step: dict[str, Any], batch: StaticBatchKV, tokens: list[int], temps: list[float],
                            greedy: list[bool]) -> None:
        import torch

        bucket, n = step["ids"].shape[0], len(tokens)
        pad = bucket - n
        self.stats["input_writes"] += 1
        with torch.inference_mode():
            ints = torch.tensor([tokens + [0] * pad, batch.lengths + [0] * pad], dtype=torch.long)
            floats = torch.tensor([temps + [1.0] * pad, [float(g) for g in greedy] + [1.0] * pad], dtype=torch.float32)
            step["ids"].copy_(ints[0].unsqueeze(1), non_blocking=False)
            step["positions"].copy_(ints[1].unsqueeze(1), non_blocking=False)
            step["column"].fill_(batch.width)
            step["temps"].copy_(floats[0])
            step["greedy"].copy_(floats[1] > 0.5)

    def _static_step(self, batch: StaticBatchKV, bucket: int, *, fused: bool = False) -> dict[str, Any]:
        """The decode step for ``bucket`` rows over ``batch``'s buffers: static inputs, and a CUDA graph of it
        when graphs are on (captured on first use; dropped when buffers or weights move). ``fused``: the
        step of :meth:`decode_sample` (mask from positions and column, sampling, inputs advanced in place)."""
        import torch

        params = self._param_list
        if params is None or params[0].data_ptr() != self._weights_key[0] or params[-1].data_ptr() != self._weights_key[1]:
            self.weights_moved()
        key = (bucket, batch.generation, fused)
        if key in self._graphs:
            return self._graphs[key]
        for old in [k for k in self._graphs if k[1] != batch.generation]:
            del self._graphs[old]
        step = self._step_buffers(batch, bucket, fused)
        cache = _static_cache([k[:bucket] for k in batch.keys], [v[:bucket] for v in batch.values], step["column"])

        from agentrl.engine.attention import decode_limit

        fused_decoder = self.fused_decoder
        keys, values = [k[:bucket] for k in batch.keys], [v[:bucket] for v in batch.values]

        def run() -> torch.Tensor:
            if fused_decoder is not None:
                return fused_decoder.decode_logits(step["ids"], step["positions"], step["column"], keys, values)
            with self._forward_context(), decode_limit(step["column"]):
                out = self.model(input_ids=step["ids"], attention_mask=step["mask"], position_ids=step["positions"],
                                 use_cache=True, **{self._cache_arg: cache})
            return out.logits[:, -1]

        def run_fused() -> torch.Tensor:
            positions, column, cols = step["positions"], step["column"], step["cols"]
            if fused_decoder is not None:  # its sampler also feeds the token back and advances the inputs
                from agentrl.engine.decoder_kernels import sample

                logits = fused_decoder.decode_logits(step["ids"], positions, column, keys, values)
                sample(logits, step["temps"], step["greedy"], step["seed"], step["out"], step["ids"], positions, column)
                return step["out"]
            # row i sees its own span and the new column; idle rows (length 0) only the new column
            allowed = (cols.unsqueeze(0) >= column - positions) & (cols.unsqueeze(0) <= column)
            mask = torch.where(allowed, step["open"], step["blocked"])[:, None, None, :]
            with self._forward_context(), decode_limit(column):
                out = self.model(input_ids=step["ids"], attention_mask=mask, position_ids=positions,
                                 use_cache=True, **{self._cache_arg: cache})
            if self.fused_ops:  # compiled Gumbel-max draw (fused_ops.kernels), one uniform per entry
                from agentrl.engine.fused_ops import kernels

                uniforms = torch.rand(out.logits[:, -1].shape, device=positions.device, dtype=torch.float32)
                chosen, chosen_lp = kernels()["sample"](out.logits[:, -1], step["temps"], step["greedy"], uniforms)
            else:
                logits = out.logits[:, -1].float()
                logprobs = torch.log_softmax(logits / step["temps"].unsqueeze(1), dim=-1)
                # inverse-CDF draw, as sampling.sample_next (one uniform per row, right=True)
                cdf = logprobs.exp().cumsum(dim=-1)
                u = torch.rand((bucket, 1), device=logits.device, dtype=cdf.dtype)
                drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
                chosen = torch.where(step["greedy"], logits.argmax(dim=-1), drawn)
                chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
            step["out"][0].copy_(chosen)
            step["out"][1].copy_(chosen_lp)
            step["ids"].copy_(chosen.unsqueeze(1))
            positions.add_(1)
            column.add_(1)
            return step["out"]

        step["run"] = lambda: step.__setitem__("logits", run())
        step["forward"] = run_fused if fused else run
        self._graphs[key] = step
        return step

    def _step_buffers(self, batch: StaticBatchKV, bucket: int, fused: bool) -> dict[str, Any]:
        """The static input buffers of a decode step (``fused``: also the sampler's and the in-place inputs')."""
        import torch

        dev = self.device
        with torch.inference_mode():
            step: dict[str, Any] = {
                "ids": torch.zeros((bucket, 1), dtype=torch.long, device=dev),
                "positions": torch.zeros((bucket, 1), dtype=torch.long, device=dev),
                "column": torch.zeros(1, dtype=torch.long, device=dev),
                "graph": None,
            }
            if fused:
                step.update(
                    temps=torch.ones(bucket, dtype=torch.float32, device=dev),
                    greedy=torch.zeros(bucket, dtype=torch.bool, device=dev),
                    cols=torch.arange(batch.columns, device=dev),
                    out=torch.zeros((2, bucket), dtype=torch.float64, device=dev),
                    # a host buffer per step in flight (_replay adds them): one step's numbers are read while
                    # later ones are still being copied
                    host=[], done=[], busy=set(),
                    blocked=torch.tensor(torch.finfo(self.dtype).min, dtype=self.dtype, device=dev),
                    open=torch.zeros((), dtype=self.dtype, device=dev),
                    # the fused decoder's sampler: Philox key, stepped by every replay (from torch's generator)
                    seed=torch.randint(0, 2**62, (1,), dtype=torch.long).to(dev),
                )
            else:
                step["mask"] = torch.zeros((bucket, 1, 1, batch.columns), dtype=self.dtype, device=dev)
        return step

    def weights_moved(self) -> None:
        """The parameters' storage may have moved (memory released/resumed): drop the captured steps."""
        self._graphs.clear()
        if self.fused_decoder is not None:  # released-and-resumed weights are no longer side by side
            self.fused_decoder.rejoin()
        self._param_list = list(self.model.parameters())
        self._weights_key = (self._param_list[0].data_ptr(), self._param_list[-1].data_ptr())

    def _capture(self, step: dict[str, Any]) -> None:
        import logging
        import time

        import torch

        began = time.perf_counter()
        self.stats["captures"] += 1
        try:
            with torch.inference_mode():
                if self._capture_stream is None:
                    self._capture_stream = torch.cuda.Stream()
                side = self._capture_stream
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    step["forward"]()
                torch.cuda.current_stream().wait_stream(side)
                if self._graph_pool is None:
                    self._graph_pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._graph_pool, stream=side):
                    step["logits"] = step["forward"]()
            step["graph"] = graph
        except Exception:  # noqa: BLE001 - eager steps are correct, only slower
            logging.getLogger(__name__).exception("CUDA graph capture failed; decoding eagerly from now on")
            self._graph_failed = True
            self.sampling_rng = torch.Generator(device=self.device)
            self.sampling_rng.seed()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        self.stats["capture_s"] += time.perf_counter() - began

    def routed_experts(self) -> list[list[int]]:
        """Per returned row of the last prefill or decode: the experts each MoE layer chose at the position its
        logits came from, flat (``layers x k``); only for MoE models (``moe_layers > 0``)."""
        from agentrl.engine import moe

        return moe.routed_experts(self.model, self._routed_rows).tolist()

    # ---- weights ------------------------------------------------------------------------------
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every loadable tensor by HF name (``state_dict`` keys: tied weights appear under both names)."""
        return dict(self.model.state_dict())

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters in HF ``named_parameters`` order (tied weights once)."""
        return [(n, p.detach()) for n, p in self.model.named_parameters()]


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return ids
