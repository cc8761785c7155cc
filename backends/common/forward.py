"""The forward ops every backend's engine shares: ``generate``, ``log_probs``, ``values`` and ``score``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from hybridflow.backends.common import modeling, turns
from hybridflow.backends.common import peft_lora as lora
from hybridflow.backends.common.micro_batches import MicroBatching

from hybridflow.agents.protocols import TurnRequest, TurnResult
from hybridflow.planner.plan import OFFLOAD_PARTS
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import GenerateBatch, RoleSpec, SamplingParams, WorkerContext


def forward_role_op(model: Any, micro_batches: list[Batch],
                    fn: Callable[[Any, Batch], dict[str, torch.Tensor]]) -> Batch:
    """A forward-only op (log-probs, values, scores) over consecutive micro batches, without gradients."""
    with torch.no_grad():
        parts = [Batch(fn(model, micro)) for micro in micro_batches]
    return Batch.concat(parts)


WAVE_SEED_STRIDE = 1_000_003


class ForwardOps(MicroBatching):
    """``generate``, ``log_probs``, ``values`` and ``score`` over an engine's HF ``model``.

    Generation runs under :meth:`whole_weights`: a sharded engine gathers its parameters for the
    duration, since generation takes a data-dependent number of forward passes per rank that
    per-forward gathers would deadlock on. The other ops go micro batch by micro batch, every rank
    in step. Engines set ``spec``, ``context``, ``model``, ``forward_batch_size``, ``forward_max_tokens`` (a token
    budget per micro batch, 0: rows) and ``padding`` (the layout's: padded rows instead of packed sequences); the
    ``hf_generate`` rollout sets ``use_hf_generate`` (HF ``generate`` instead of the lean cached loop).
    """

    spec: RoleSpec
    context: WorkerContext
    model: Any
    forward_batch_size: int
    rollout_batch_size: int = 0  # the layout's: most sequences decoded together per rank (0: the whole share)
    use_hf_generate: bool = False
    forward_max_tokens: int = 0  # the layout's token budget of a forward micro batch (0: rows)
    weights_version: int = 0  # the updates these weights have had (GradientSteps.train_step): what turns carry
    offloaded: frozenset[str] = frozenset()  # the parts it keeps in host memory (RoleLayout.offloaded)
    tensor_parallel: int = 1  # the layout's tp: consecutive ranks that split each layer and share their rows

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel shard: tensor-parallel peers sample alike (their forwards are collectives)."""
        return self.context.rank // self.tensor_parallel

    @contextlib.contextmanager
    def whole_weights(self) -> Iterator[None]:
        """Whole parameters on this rank for the duration (a replica holds them already)."""
        yield

    def executed_sharding(self) -> str:
        """The sharding this engine runs (a replica per rank, unless a sharded engine says otherwise)."""
        return "NO_SHARD"

    def executed_layout(self) -> dict[str, Any]:
        """What this engine runs, in :class:`~hybridflow.planner.RoleLayout` field names (read back by the
        worker's ``info()``, so a test or a user can check the run is the plan)."""
        return {"sharding": self.executed_sharding(), "micro_batch_size": getattr(self, "micro_batch_size", None),
                "forward_micro_batch_size": self.forward_batch_size, "rollout_batch_size": self.rollout_batch_size,
                "padding": self.padding, "max_tokens_per_micro_batch": getattr(self, "max_tokens", 0),
                "forward_max_tokens_per_micro_batch": self.forward_max_tokens,
                "gradient_checkpointing": bool(getattr(self.model, "is_gradient_checkpointing", False)),
                "tp": self.tensor_parallel,
                **{f"offload_{part}": part in self.offloaded for part in OFFLOAD_PARTS}}

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """Samples in waves of at most ``rollout_batch_size`` rows (the plan's bound on sequences in flight,
        which bounds the KV cache); wave ``i`` samples with the rank's seed plus ``i`` x 1,000,003."""
        size = self.rollout_batch_size or len(batch)
        waves = batch.split(size) if len(batch) > size else [batch]
        outputs = []
        with torch.no_grad(), self.whole_weights():
            for index, wave in enumerate(waves):
                outputs.append(modeling.generate(
                    self.model, wave, max_new_tokens=sampling.max_new_tokens, greedy=sampling.greedy,
                    temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                    seed=sampling.rank_seed(self.data_parallel_rank) + index * WAVE_SEED_STRIDE,
                    use_hf_generate=self.use_hf_generate, logprobs=sampling.logprobs))
        if len(outputs) == 1:
            return Batch(outputs[0])
        return Batch(modeling.join_responses(outputs, pad=self.model.config.pad_token_id))

    @contextlib.contextmanager
    def turn_session(self, sampling: SamplingParams) -> Iterator[GenerateBatch]:
        """Agent turns with this model (:class:`~hybridflow.runtime.protocols.TurnGenerator`), in waves of at most
        ``rollout_batch_size`` requests. The whole parameters stay gathered for the session: each rank samples a
        data-dependent number of batches, which per-forward gathers would deadlock on."""
        device = torch.device(self.context.device)

        def generate_batch(requests: Sequence[TurnRequest]) -> list[TurnResult]:
            size = self.rollout_batch_size or len(requests)
            with torch.no_grad():  # grad mode is per thread: the server thread calls this
                return [result for start in range(0, len(requests), size)
                        for result in turns.sample_turns(self.model, requests[start:start + size], sampling,
                                                         device=device, version=self.weights_version)]

        with self.whole_weights():
            yield generate_batch

    def forward_micro_batches(self, batch: Batch) -> list[Batch]:
        return self.micro_batches(batch, rows=self.forward_batch_size, max_tokens=self.forward_max_tokens)

    def log_probs(self, batch: Batch, *, with_entropy: bool = False, adapters: bool = True) -> Batch:
        """Log-probs (and entropy) of the responses; ``adapters=False`` under a LoRA policy's base model (its
        adapters disabled for the call: a reference for free)."""
        base = contextlib.nullcontext() if adapters else lora.disabled(self.model, role=self.spec.name)
        with base:
            return forward_role_op(self.model, self.forward_micro_batches(batch),
                                   lambda model, m: modeling.policy_outputs(model, m, with_entropy=with_entropy,
                                                                           packed=not self.padding))

    def values(self, batch: Batch) -> Batch:
        return forward_role_op(self.model, self.forward_micro_batches(batch),
                               lambda model, m: modeling.value_outputs(model, m, packed=not self.padding))

    def score(self, batch: Batch) -> Batch:
        return forward_role_op(self.model, self.forward_micro_batches(batch),
                               lambda model, m: {"scores": modeling.reward_model_scores(
                                   model, m, packed=not self.padding)})
