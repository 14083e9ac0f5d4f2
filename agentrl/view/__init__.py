"""``agentrl view RUN_DIR``: a run's samples token by token, its curves and checkpoints, in the browser.

Top layer (beside :mod:`agentrl.cli`): it only reads what a run wrote (``samples/step-N.jsonl``,
``metrics.jsonl``, ``checkpoints/``) and imports :mod:`agentrl.trajectory` for the sample format.
"""
