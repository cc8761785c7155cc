"""What every backend shares: HF model loading and forward passes (``modeling``), the lean sampling loop
(``sampling``), forward ops in micro batches (``forward``), the update loop (``training``), the rollouts
every training backend offers (``rollout``: ``native``, ``hf_generate``), the hybrid engine that pairs a
trainer with any other rollout engine in one process (``hybrid``) and joining torch.distributed
(``distributed``).

A training backend is then a :class:`~hybridflow.backends.common.engine.TrainingEngine` (``engine``: the shared
construction path and pass sequence) filling in its hooks: how its weights are held (replicated, FSDP-sharded, ZeRO
partitioned), how one micro batch goes backward and one optimizer step is taken, and how its state is saved and
loaded.
"""
