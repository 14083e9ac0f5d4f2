"""Inference engines: the embedded SGLang-API-compatible server and a launcher for real SGLang.

* ``python -m agentrl.engine --model DIR --port N`` -- the embedded engine (``server.py`` over
  ``engine.py``: continuous batching in one worker thread, prefix KV reuse, atomic weight updates).
* :class:`agentrl.engine.launch.EngineProcess` -- start/stop that server as a subprocess.
* :class:`agentrl.engine.sglang.SGLangProcess` -- the same for real SGLang (GPU clusters).
* :mod:`agentrl.engine.process` -- server processes tied to their parent (they die with it) and their logs.
* :mod:`agentrl.engine.protocol` -- request validation, the model's context length; ``scheduler``,
  ``model_runner``, ``sampling``, ``prefix_cache``, ``memory``, ``metrics`` -- the engine's parts.
* :mod:`agentrl.engine.weight_routes` / ``delta`` / ``cuda_ipc`` -- the weight-update routes and payloads.
* :mod:`agentrl.engine.weight_loading` -- trainer-side payload builders for ``/update_weights_from_tensor``
  and the checksum behind ``GET /weights_checksum``; :mod:`agentrl.engine.weight_group` -- the process
  group of ``/update_weights_from_distributed``.

Nothing heavy is imported here: torch, transformers and FastAPI load only with the modules that need them.
"""
