"""agentrl.weights: getting the trainer's new weights into the engines, bit for bit.

A sync is a *payload* (what is sent: ``full`` in :mod:`~agentrl.weights.sync`, ``delta`` in
:mod:`~agentrl.weights.delta_sync`) over a *transport* (how it travels: :mod:`~agentrl.weights.transport`,
one module per built-in under :mod:`~agentrl.weights.transports`); both are explained there::

    make_sync("delta", urls)                          # delta + zstd over files on /dev/shm (the default)
    make_sync("delta", urls, transport="broadcast")   # the same payload over a process group
    make_sync("full", urls, transport="pkg.mod:MyTransport")   # a transport of your own, by path

Also: :mod:`~agentrl.weights.engines` (calls to every engine, or through an smg router's RL fan-out),
:mod:`~agentrl.weights.bucket` (flattened per-dtype buckets), :mod:`~agentrl.weights.delta` (the delta
encoder and snapshot; wire format and receiver: :mod:`agentrl.engine.delta`), :mod:`~agentrl.weights.convert`
(HF <-> Megatron names and layouts). Nothing heavy is imported here.
"""
