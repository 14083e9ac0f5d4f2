"""The ``adapter`` payload: a LoRA-trained policy's adapters, not its weights.

What travels is ``<module>.lora_A.weight`` ([r, in]) and ``<module>.lora_B.weight`` ([out, r], scaled by
``alpha / r``) per adapted HF module, as named tensors over any transport that carries full weights
(``disk`` by default, ``tensor``, ``broadcast``); the embedded engine merges them into its weights from
an exact copy of its base (:mod:`agentrl.engine.lora`). At rank 16 on a 0.5B shape that is about 1.8 %
of the model's bytes.

``SyncReport.full_bytes`` is the dense model's size (``dense_bytes=``, what a full sync would send), so
``bytes_sent / full_bytes`` is the saving; without it, the adapters' own size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agentrl.engine.weight_loading import EMBEDDED_ENGINE
from agentrl.weights.sync import FullSync, PayloadOptions, full_bytes, payload_class, sync_options
from agentrl.weights.transport import Transport, builtin_transports

if TYPE_CHECKING:
    import torch

ADAPTER_MODE = "adapter"


def adapter_named_tensors(adapters: Iterable[tuple[str, torch.Tensor, torch.Tensor]],
                          scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """``(module, A, B)`` triples (``B`` unscaled) as the named tensors this payload sends."""
    for module, a, b in adapters:
        yield f"{module}.lora_A.weight", a
        yield f"{module}.lora_B.weight", b * scale


def sends_adapters(mode: Any) -> bool:
    """Whether sync mode ``mode`` (a name, path or class) sends adapters, so the trainer must export them."""
    return issubclass(payload_class(mode), AdapterSync)


def adapter_options(options: PayloadOptions | Mapping[str, Any]) -> PayloadOptions:
    """Another payload's validated ``sync_options`` re-validated for ``adapter``: the keys set keep their
    values; one that is that payload's own (e.g. delta's ``snapshot_budget_bytes``) is refused by name."""
    values = options.model_dump(include=options.model_fields_set) if isinstance(options, PayloadOptions) else dict(options)
    return sync_options(AdapterSync, values)


class AdapterSync(FullSync):
    """``adapter`` (see module doc): the adapters as named tensors over the transport's full path."""

    payload = ADAPTER_MODE
    Options = PayloadOptions
    needs_engine = EMBEDDED_ENGINE  # the merge is agentrl's engine's (SGLang loads LoRA by its own routes)

    def __init__(self, engine_urls: Sequence[str], *, dense_bytes: int | None = None, **values: Any) -> None:
        """``dense_bytes``: the full model's bytes, reported as ``full_bytes``."""
        super().__init__(engine_urls, **values)
        self.dense_bytes = dense_bytes

    @classmethod
    def check_carried(cls, transport: type[Transport]) -> None:
        if "full" not in transport.carries:
            able = sorted(n for n, c in builtin_transports().items() if "full" in c.carries)
            raise ValueError(f"adapters travel as named tensors; the {transport.label()} transport cannot carry "
                             f"them; choose from {able}")

    def full_size(self, tensors: list[tuple[str, torch.Tensor]]) -> int:
        return self.dense_bytes if self.dense_bytes is not None else full_bytes(tensors)
