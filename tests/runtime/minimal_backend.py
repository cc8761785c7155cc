"""A backend written from ``hybridflow.runtime.protocols`` alone: a bigram policy (a V x V logit table).

It imports nothing from ``hybridflow.backends``: it proves a third party can implement the contract
from the protocols and their docstrings. Use it as ``RoleSpec(backend="<this file>:BACKEND")``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.planner import RoleLayout
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import LossFn, RoleSpec, SamplingParams, WorkerContext, parse_options


@dataclass(frozen=True, kw_only=True)
class BigramOptions:
    vocab_size: int = 64
    trains: bool = True  # False: build an engine without the Trainer capability
    closed_log: str = ""  # a file each engine appends its role name to when closed
    generate_delay_s: float = 0.0  # seconds each generate call sleeps (a slow rollout, for pipeline tests)
    train_delay_s: float = 0.0  # seconds each train step sleeps (a slow trainer)


class BigramEngine:
    """Generator, LogProbModel, WeightSource and WeightSink (and Trainer, see :class:`TrainableBigram`)."""

    def __init__(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> None:
        self.options = parse_options(BigramOptions, spec.options, role=spec.name, owner="bigram")
        self.spec, self.context = spec, context
        self.table = torch.nn.Parameter(torch.zeros(self.options.vocab_size, self.options.vocab_size))

    def _previous(self, batch: Batch) -> torch.Tensor:
        """(B, T): the token before each response position (prompts are left-padded: the last is real)."""
        return torch.cat([batch["prompts"][:, -1:], batch["responses"][:, :-1]], dim=1)

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        generator = torch.Generator().manual_seed(sampling.rank_seed(self.context.rank))
        time.sleep(self.options.generate_delay_s)
        token, tokens = batch["prompts"][:, -1], []
        for _ in range(sampling.max_new_tokens):
            probs = torch.softmax(self.table.detach()[token] / sampling.temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            tokens.append(token)
        responses = torch.stack(tokens, dim=1)
        return Batch({"responses": responses, "response_mask": torch.ones_like(responses)})

    def _outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        logits = self.table[self._previous(batch)]  # (B, T, V)
        logp = torch.log_softmax(logits, dim=-1)
        return {"logprobs": logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1),
                "entropy": -(logp.exp() * logp).sum(dim=-1)}

    def log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch:
        with torch.no_grad():
            out = self._outputs(batch)
        return Batch(out if with_entropy else {"logprobs": out["logprobs"]})

    def iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "table", self.table.detach()

    def tied_weights(self) -> Mapping[str, str]:
        return {}

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self.table.copy_(dict(named)["table"])

    def close(self) -> None:
        if self.options.closed_log:
            with open(self.options.closed_log, "a") as log:
                log.write(f"{self.spec.name}\n")


class TrainableBigram(BigramEngine):
    """Adds the Trainer capability: plain SGD, gradients averaged over the group."""

    def __init__(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> None:
        super().__init__(spec, layout, context)
        self.optimizer = torch.optim.SGD([self.table], lr=spec.optim.lr if spec.optim else 0.1)

    def train_step(self, batch: Batch, *, loss: LossFn, options: Mapping[str, Any]) -> dict[str, float]:
        time.sleep(self.options.train_delay_s)
        self.optimizer.zero_grad()
        value, stats = loss(outputs=self._outputs(batch), batch=dict(batch.tensors), **options)
        value.backward()
        assert self.table.grad is not None
        self.context.collective.all_reduce_mean([self.table.grad])
        self.optimizer.step()
        return {"loss": float(value.detach()), **{key: float(stat) for key, stat in stats.items()}}

    def save_checkpoint(self, directory: str) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save({"table": self.table.detach()}, Path(directory) / "table.pt")

    def load_checkpoint(self, directory: str) -> None:
        self.load_weights(torch.load(Path(directory) / "table.pt", weights_only=True).items())


class BigramBackend:
    name = "bigram"

    def build_role(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> BigramEngine:
        trains = parse_options(BigramOptions, spec.options, role=spec.name, owner="bigram").trains
        return TrainableBigram(spec, layout, context) if trains and spec.kind.trainable else BigramEngine(
            spec, layout, context)


BACKEND = BigramBackend()
