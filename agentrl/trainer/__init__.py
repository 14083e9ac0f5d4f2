"""agentrl.trainer: the Megatron-core GRPO trainer.

Modules (heavy imports stay inside them, so ``import agentrl.trainer`` is instant):

* :mod:`~agentrl.trainer.actor` - ``MegatronTrainer(model_dir, TrainerConfig)``: ``compute_logprobs``,
  ``train_step``, ``export_hf_named_tensors``, ``save_checkpoint`` / ``load_checkpoint``;
* :mod:`~agentrl.trainer.trainer_config` - ``TrainerConfig``, the typed ``trainer`` config section;
* :mod:`~agentrl.trainer.losses` - GRPO / Dr.GRPO advantages, PPO clip (asymmetric, dual), KL
  estimators, token / GSPO ratios and truncated IS as plug-ins, normalisations (pure tensor functions);
* :mod:`~agentrl.trainer.credit` - ``credit_fn`` plug-ins that may only narrow loss masks;
* :mod:`~agentrl.trainer.model` / :mod:`~agentrl.trainer.attention` - GPTModel from a HF config,
  local / SDPA / TransformerEngine attention;
* :mod:`~agentrl.trainer.batch` / :mod:`~agentrl.trainer.chunked_logprobs` - micro-batches from Samples,
  vocab-parallel log-probs and entropy in chunks (never all logits at once);
* :mod:`~agentrl.trainer.checkpoint` - ``dist_checkpointing`` save / resume;
* :mod:`~agentrl.trainer.parallel` / :mod:`~agentrl.trainer.cpu_shims` - process groups, CPU shims.

It imports only :mod:`agentrl.trajectory` and :mod:`agentrl.weights` (HF <-> Megatron conversion); the
run's orchestration (loop, Ray actors, warm-up, run config) is :mod:`agentrl.run`.
"""
