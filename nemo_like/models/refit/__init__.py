"""Refit: moving the policy's new weights into the generation engines, in one place.

Two sides, one interface between them. The policy side (``PolicyWorker``'s export methods in
:mod:`nemo_like.models.policy.weight_export`, ``Policy.weight_buckets``) exports; the engine side (the
generation workers in :mod:`nemo_like.models.generation`) receives. What travels is a
:class:`~.buckets.WeightBuckets` (or its shared-memory form :class:`~.shared_memory.SharedWeights`), or,
on GPU, CUDA-IPC handles / an NCCL broadcast described by a manifest.

Which transport when (decided in :mod:`.transport`):

* **shared memory** (:mod:`.shared_memory`): full-weight refits on a one-node CPU cluster: one buffer in
  ``/dev/shm`` the engines map (:func:`~.transport.shared_memory_refit_possible`);
* **object store** (:mod:`.buckets`): otherwise on CPU, with several policy ranks, with LoRA (adapters under
  ``kind="adapter"`` or merged weights) and on GPU without an attached policy: buckets of at most
  ``policy.refit_buffer_size_mb`` gathered from the shards;
* **CUDA IPC** (:mod:`.cuda`): GPU, one policy rank, vLLM colocated on its GPU: zero-copy handles;
* **NCCL broadcast** (:mod:`.cuda`): GPU, one policy rank, vLLM on its own GPUs.

On the engine side every refit's names are checked against the engine's own (:mod:`.manifest`), a vLLM
CPU engine loads full weights in place (:mod:`.cpu_reload`, vLLM's ``reload_weights`` otherwise), and an
update that arrives during a ``generate`` call is applied between two decoding steps (:mod:`.gate`, the
in-flight gate).

This package imports neither the policy nor generation (the ``models-layers`` contract in pyproject.toml),
and nothing here imports Ray or vLLM at module level: the GPU check's tier A imports :mod:`.cuda` without them.
"""
