"""agentrl.run: the orchestration of a training run, the top layer below the command line.

* :mod:`~agentrl.run.config` - ``RunConfig``, one typed model of every section, ``load_config``;
* :mod:`~agentrl.run.session` - ``Run``: the verbs generate / train / update_weights / evaluate / save;
* :mod:`~agentrl.run.schedules` - the schedules (``sync``, one-step-off ``async``, ``fully_async``) and ``train``;
* :mod:`~agentrl.run.actors` - the Ray actors (trainer ranks, the rollout worker);
* :mod:`~agentrl.run.models` - the cached base and warm-up model directories;
* :mod:`~agentrl.run.warmup` - supervised warm-up on expert chats;
* :mod:`~agentrl.run.bookkeeping` - metrics log, checkpoint directory, reward curve;
* :mod:`~agentrl.run.train_only`, :mod:`~agentrl.run.cli` - ``agentrl train`` and its debug mode;
* :mod:`~agentrl.run.check_logprobs`, :mod:`~agentrl.run.check_weight_sync` - diagnostic commands.

Imports stay inside functions, so ``import agentrl.run`` pulls neither Ray nor torch.
"""
