"""LoRA adapters in the embedded engine: merged into its weights from an exact copy of the base.

An adapter update is a weight update whose every tensor is named ``<module>.lora_A.weight`` ([r, in]) or
``<module>.lora_B.weight`` ([out, r], the scale ``alpha / r`` already applied) with ``<module>.weight``
a parameter of the model. It arrives through the ordinary routes (``/update_weights_from_disk``,
``/update_weights_from_tensor``): :class:`AdapterMerger` turns it into dense weights
``base + B @ A`` (summed in fp32, rounded once to the weight's dtype) that the engine loads as any
update, so decoding keeps its kernels and costs nothing extra.

The base is copied the first time a weight is adapted and kept until a non-adapter update replaces the
weights, so each merge starts from the exact base bits, never from the last merge (no drift). A module
adapted before but missing from an update goes back to its base. The copy costs the adapted weights'
memory once more; the merge one ``[out, r] @ [r, in]`` product per module per sync.

``/release_memory_occupation`` of the weights moves the copy to the host with them (:meth:`AdapterMerger.release`)
and resume moves it back. It is kept, never dropped: resume restores the *merged* bits the engine held (no
write in between, :mod:`agentrl.engine.memory`), so this copy is the only exact base left for the next merge.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agentrl.engine.engine import WeightUpdateError

if TYPE_CHECKING:
    import torch

A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


def is_adapter_update(tensors: Mapping[str, Any]) -> bool:
    """Whether ``tensors`` are adapters (every name an ``A`` or ``B``); a mix is refused by :meth:`AdapterMerger.merge`."""
    return bool(tensors) and any(n.endswith((A_SUFFIX, B_SUFFIX)) for n in tensors)


def _pairs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (A, B)}``; ``WeightUpdateError`` for a name that is no adapter, or an ``A`` without its ``B``."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        for key, suffix in (("A", A_SUFFIX), ("B", B_SUFFIX)):
            if name.endswith(suffix):
                modules.setdefault(name[: -len(suffix)], {})[key] = t
                break
        else:
            raise WeightUpdateError(f"an adapter update holds only lora_A/lora_B tensors; got {name!r}")
    lone = sorted(m for m, ab in modules.items() if len(ab) != 2)
    if lone:
        raise WeightUpdateError(f"adapter(s) without both lora_A and lora_B: {', '.join(lone[:8])}")
    return {m: (ab["A"], ab["B"]) for m, ab in modules.items()}


class AdapterMerger:
    """One engine's adapter state: the base copy of every adapted weight, and the engine's count of weight
    writes (``Engine.weight_writes``) right after its last merge landed."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}
        self.merged_at: int | None = None
        self.released = False  # the base copy is on the host with the released weights
        self._lock = threading.Lock()  # merge, release and resume each run in a worker thread

    def merge(self, weights: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor],
              weight_writes: int) -> dict[str, torch.Tensor]:
        """The dense weights for adapter ``tensors`` on the model ``weights`` (HF name -> tensor), which have
        seen ``weight_writes`` writes; checked (names, shapes, finite) before anything is copied."""
        with self._lock:
            if self.released:
                raise WeightUpdateError("weights are released (release_memory_occupation); resume them first")
            return self._merge(weights, tensors, weight_writes)

    def _merge(self, weights: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor],
               weight_writes: int) -> dict[str, torch.Tensor]:
        import torch

        if weight_writes != self.merged_at:  # some other write (full, flat, delta) since our merge: a new base
            self.base.clear()
        merged: dict[str, torch.Tensor] = {}
        for module, (a, b) in _pairs(tensors).items():
            name = f"{module}.weight"
            w = weights.get(name)
            if w is None:
                raise WeightUpdateError(f"adapter for {module!r}: the model has no parameter {name!r}")
            if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w.shape):
                raise WeightUpdateError(f"adapter for {module!r}: lora_B {tuple(b.shape)} @ lora_A {tuple(a.shape)} "
                                        f"does not make the weight's {tuple(w.shape)}")
            delta = b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)
            if not torch.isfinite(delta).all():
                raise WeightUpdateError(f"adapter for {module!r} is not finite")
            base = self.base.get(name)
            if base is None:
                base = w.detach().clone()
            merged[name] = (base.float() + delta).to(w.dtype)
            self.base.setdefault(name, base)
        for name in set(self.base) - set(merged):
            merged[name] = self.base[name]
        return merged

    def release(self) -> None:
        """The engine's weights were released: the base copy goes to the host too, bit for bit (on the CPU it
        is there already and nothing is freed, as for the weights themselves)."""
        import torch

        with self._lock:
            if self.released:
                return
            on_device = any(t.device.type != "cpu" for t in self.base.values())
            self.base = {n: t.to("cpu") for n, t in self.base.items()}
            self.released = True
            if on_device and torch.cuda.is_available():
                torch.cuda.empty_cache()  # a colocated trainer is another process: give the cached blocks back

    def resume(self, device: torch.device | str) -> None:
        """The weights are back on ``device``: so is the base copy (the next merge starts from it)."""
        with self._lock:
            if not self.released:
                return
            self.base = {n: t.to(device) for n, t in self.base.items()}
            self.released = False

    def forget(self) -> None:
        """A non-adapter update replaced the weights: they are the next base."""
        self.base.clear()
        self.merged_at = None
