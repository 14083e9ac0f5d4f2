"""agentrl.weights: getting the trainer's new weights into the engines, bit for bit.

Senders take HF-named tensors (``Iterable[tuple[str, torch.Tensor]]``) and a ``weight_version``;
``sync()`` returns a :class:`~agentrl.weights.sync.SyncReport` once every engine holds the bits and
reports the version. Pick one with :func:`agentrl.weights.sync.make_sync` (``disk``, ``tensor``,
``broadcast``, ``delta``, or a ``module:Class`` of your own :class:`~agentrl.weights.sync.WeightSync`).

* :mod:`~agentrl.weights.sync` -- the interface and factory.
* :mod:`~agentrl.weights.disk_sync`, :mod:`~agentrl.weights.tensor_sync`,
  :mod:`~agentrl.weights.broadcast_sync`, :mod:`~agentrl.weights.delta_sync` -- one mode each; ``tensor``
  and ``delta`` take ``transport=`` (delta: ``disk`` files or the ``broadcast`` process group).
* Every sender takes ``router_url=`` (an smg router with ``--enable-rl``) to send same-body update calls
  through the router's RL fan-out instead of to each engine.
* :mod:`~agentrl.weights.bucket` -- flattened per-dtype buckets; :mod:`~agentrl.weights.delta` -- the delta
  encoder and bounded snapshot (the wire format and receiver are :mod:`agentrl.engine.delta`).
* :mod:`~agentrl.weights.engines` -- concurrent calls to every engine's weight endpoints.
* :mod:`~agentrl.weights.convert` -- HF <-> Megatron names and layouts (the trainer's).

Nothing heavy is imported here.
"""
