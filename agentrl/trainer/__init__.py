"""agentrl.trainer: the Megatron-core GRPO trainer.

Modules (heavy imports stay inside them, so ``import agentrl.trainer`` is instant):

* :mod:`~agentrl.trainer.actor` - ``MegatronTrainer(model_dir, TrainerConfig)``: ``compute_logprobs``,
  ``train_step``, ``export_hf_named_tensors``, ``save_checkpoint`` / ``load_checkpoint``;
* :mod:`~agentrl.trainer.trainer_config` - ``TrainerConfig`` and the dotted-path plug-in loader;
* :mod:`~agentrl.trainer.losses` - GRPO / Dr.GRPO advantages, PPO clip (asymmetric, dual), KL
  estimators, TIS, GSPO, normalisations, dynamic-sampling filter (pure tensor functions);
* :mod:`~agentrl.trainer.model` / :mod:`~agentrl.trainer.attention` - GPTModel from a HF config,
  local / SDPA / TransformerEngine attention;
* :mod:`~agentrl.trainer.batch` / :mod:`~agentrl.trainer.logprobs` - micro-batches from Samples,
  vocab-parallel log-probs and entropy;
* :mod:`~agentrl.trainer.checkpoint` - ``dist_checkpointing`` save / resume;
* :mod:`~agentrl.trainer.parallel` / :mod:`~agentrl.trainer.cpu_shims` - process groups, CPU shims;
* :mod:`~agentrl.trainer.check_logprobs` - ``agentrl check-logprobs``.

HF <-> Megatron weight conversion lives in :mod:`agentrl.weights.convert`.
"""
