"""A real trainer process for test_checkpoint_integrity.py to ``kill -9`` while it saves.

``python checkpoint_worker.py TINY_DIR ROOT MODE``: trains one step, saves ``ROOT/step-1`` and its
weights (``ROOT/step-1.weights.pt``), then

* ``pause-before-seal``: starts saving ``ROOT/step-2`` and stops for good once the shards are written,
  before the manifest (``ROOT/paused`` says it is there);
* ``loop``: waits for ``ROOT/go`` (so that it can be started early, its imports and first step beside
  another test's work), then trains and saves ``ROOT/step-2`` over and over (``ROOT/saved-2`` after the
  first complete one), so a kill lands in the middle of replacing an earlier step-2.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def main(tiny: Path, root: Path, mode: str) -> None:
    import torch
    from trainer_samples import synthetic_samples

    from agentrl.trainer import checkpoint
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    trainer = MegatronTrainer(tiny, TrainerConfig(lr=1e-3))
    trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=1))
    trainer.save_checkpoint(root / "step-1", {"weight_version": 1})
    torch.save(dict(trainer.export_hf_named_tensors()), root / "step-1.weights.pt")
    if mode == "pause-before-seal":
        def pause(path: Path) -> None:
            (root / "paused").write_text(str(path))
            time.sleep(3600)

        checkpoint._seal = pause
        trainer.save_checkpoint(root / "step-2", {"weight_version": 2})
    elif mode == "loop":
        while not (root / "go").exists():
            time.sleep(0.01)
        seed = 2
        while True:
            trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=seed))
            trainer.step = 2  # every save is "step 2" again: an earlier attempt's checkpoint is replaced
            trainer.save_checkpoint(root / "step-2", {"weight_version": seed})
            (root / "saved-2").write_text(str(seed))
            seed += 1
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
