"""The built-in weight transports, one module each (registered in :data:`agentrl.weights.transport.TRANSPORTS`):

* :mod:`~agentrl.weights.transports.disk`: files on tmpfs or any shared directory; full and delta.
* :mod:`~agentrl.weights.transports.tensor`: ``/update_weights_from_tensor`` with shared-memory or CUDA IPC
  handles, or safetensors bytes in the body; full only.
* :mod:`~agentrl.weights.transports.broadcast`: a process group with every engine; full and delta.
"""
