"""agentrl.run: the orchestration of a training run, the top layer below the command line.

Start at :mod:`~agentrl.run.config` (``RunConfig``, ``load_config``), :mod:`~agentrl.run.session` (``Run``:
generate / train / update_weights / evaluate / save) and :mod:`~agentrl.run.schedules` (``sync``, ``async``,
``fully_async``, each a screen of those verbs); every other module serves one of them and says so.

Imports stay inside functions, so ``import agentrl.run`` pulls neither Ray nor torch.
"""
