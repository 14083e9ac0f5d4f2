"""agentrl.weights: getting the trainer's new weights into the engines, bit for bit.

Senders take HF-named tensors (``Iterable[tuple[str, torch.Tensor]]``) and a ``weight_version``;
``sync()`` returns a :class:`~agentrl.weights.sync.SyncReport` once every engine holds the bits and
reports the version. A sync is a *payload* (what is sent) over a *transport* (how it travels)::

    make_sync("delta", urls)                          # delta + zstd over files on /dev/shm (the default)
    make_sync("delta", urls, transport="broadcast")   # the same payload over a process group
    make_sync("full", urls, transport="broadcast")    # every tensor over the group (= "broadcast")
    make_sync("full", urls, transport="pkg.mod:MyTransport")   # a transport of your own, by path

* :mod:`~agentrl.weights.sync` -- :class:`~agentrl.weights.sync.WeightSync` (payload base), the ``full``
  payload and :func:`~agentrl.weights.sync.make_sync`; :mod:`~agentrl.weights.delta_sync` -- the
  ``delta`` payload. The historical modes ``disk``, ``tensor``, ``broadcast`` are ``full`` presets.
* :mod:`~agentrl.weights.transport` -- the transport interface, its typed options and the registry; one
  module per transport in :mod:`~agentrl.weights.transports`: ``disk``, ``tensor`` (full only), ``broadcast``.
* Every sender takes ``router_url=`` (an smg router with ``--enable-rl``) to send same-body update calls
  through the router's RL fan-out instead of to each engine (:mod:`~agentrl.weights.engines`).
* :mod:`~agentrl.weights.bucket` -- flattened per-dtype buckets; :mod:`~agentrl.weights.delta` -- the delta
  encoder and bounded snapshot (the wire format and receiver are :mod:`agentrl.engine.delta`).
* :mod:`~agentrl.weights.convert` -- HF <-> Megatron names and layouts (the trainer's).

Nothing heavy is imported here.
"""
