"""What every backend shares: HF model loading and forward passes (``modeling``), the lean sampling loop
(``sampling``), forward ops in micro batches (``forward``), the update loop (``training``), the rollout
engine choice (``rollout``) and joining torch.distributed (``distributed``).

A backend is then an engine class saying how its weights are held (replicated, FSDP-sharded, ZeRO
partitioned) and how one micro batch goes backward and one optimizer step is taken.
"""
