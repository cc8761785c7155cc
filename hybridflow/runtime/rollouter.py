"""The ``async`` pipeline's rollout side: a detached rollout generating continuously, at most k updates ahead.

A :class:`Rollouter` thread keeps the rollout group busy with the prompts of the steps the controller has
offered. The batch of step ``s`` may start once the rollout holds weights of version ``s - k`` or newer
(``max_staleness`` k; a version counts the policy's updates since step 0), so every token of it is at most
k updates older than the trainer that takes it at step ``s``. With ``k = 0`` a batch waits for the
weights of the step before: the ``sync`` schedule on split pools, sample for sample.

Two ways to generate:

- whole batches (``segment_tokens=None``): one generate call per step's batch, seeded as ``sync`` seeds it;
- partial rollouts (``segment_tokens=S``): the rollout runs *segments* of at most S new tokens over the
  sequences in flight. Between segments the rollout group's queue applies any weights the trainer shipped,
  so a long response continues under the new policy (AReaL/verl fully-async "partial rollout"), and
  each token records the version that sampled it. Slots that finish early take rows of the next
  admissible step at once (continuous batching across steps), so a batch's long tail no longer idles the
  engine. A segment continues a sequence by generating again from its prompt plus the response so far;
  response-aligned outputs (``responses``, ``response_mask``, ``rollout_logprobs``) are concatenated.

Every sample gets ``policy_version`` (the oldest version among its tokens) and ``token_policy_version``
(per token). Generation order across segments depends on when weights arrive, so partial rollouts are
not bit-reproducible from a seed (neither are verl's or AReaL's); whole batches are.

Checkpoints: :meth:`Rollouter.snapshot` waits for the generate call running (if any) and returns the work
held for later steps (:class:`~hybridflow.runtime.rollout_state.RolloutState`: batches ready, sequences in
flight with their tokens' versions, the segment counter); :meth:`Rollouter.restore` puts it back before a
resumed run starts, so it continues from the state the uninterrupted run had.

Failures: an error in the rollout (a dead worker) is kept and raised by the next :meth:`Rollouter.take`;
rows still in flight are dropped with the rollouter (a resumed run restores the checkpoint's rollout state:
nothing the trainer used is lost, the work since the checkpoint is).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from hybridflow.graph import Node
from hybridflow.graph.node import freeze_options
from hybridflow.planner.execution import ExecutionMode
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.dispatch import Target, node_inputs
from hybridflow.runtime.rollout_state import RESPONSE_FIELD, InFlight, Pending, RolloutState

MASK_FIELD = "response_mask"


@dataclass
class RolloutStats:
    """Running totals of the rollout pool, read as deltas per step."""

    busy_s: float = 0.0
    tokens: int = 0
    segments: int = 0


class Rollouter:
    """Generates the offered steps' batches on a detached rollout (see the module docstring)."""

    def __init__(self, node: Node, target: Target, *, mode: ExecutionMode, seed: int,
                 eos_token_id: int | None = None, capacity: int | None = None, tokenizer: Any = None) -> None:
        self.max_new_tokens = node.max_new_tokens
        segment_tokens = mode.segment_budget(self.max_new_tokens)
        # A multi-turn node's partial rollouts are its turns: the trajectories run here, every batch of ready turns
        # one call on the rollout's queue, so weights shipped meanwhile land between turns.
        self.turn_segments = bool(node.environment) and segment_tokens is not None
        if self.turn_segments and tokenizer is None:
            raise ValueError(f"generate node {node.name!r}: multi-turn partial rollouts template observations on the "
                             "driver and need the policy's tokenizer; pass tokenizer=")
        self.tokenizer = tokenizer
        if segment_tokens is not None and eos_token_id is None:
            raise ValueError("partial rollouts need the policy's eos_token_id to tell a finished response from "
                             "one cut at a segment's end; pass eos_token_id= or segment_tokens=None")
        self.node, self.target, self.k, self.seed = node, target, mode.k, seed
        self.segment_tokens, self.eos, self.capacity = segment_tokens, eos_token_id, capacity
        self.weights_version = 0
        self.stats = RolloutStats()
        self._offered: dict[int, Pending] = {}
        self._ready: dict[int, Batch] = {}
        self._flight: list[InFlight] = []
        self._pads: dict[str, float] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self._busy = False  # a generate call is running (its results not yet recorded)
        self._paused = False  # a snapshot is being taken: start no new call
        self.restored = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="rollouter", daemon=True)

    # ---- the controller's side ----------------------------------------------------------------------
    def start(self, version: int) -> None:
        """Begin generating; the rollout holds weights of ``version`` (the step the run starts at)."""
        with self._cv:
            self.weights_version = version
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def offered(self, step: int) -> bool:
        with self._cv:
            return step in self._offered or step in self._ready

    def offer(self, step: int, rows: Batch) -> None:
        """Queue the generation of ``step``'s rows (prompts already expanded to one row per sample)."""
        with self._cv:
            self._offered[step] = Pending(rows)
            self._cv.notify_all()

    def weights_loaded(self, version: int) -> None:
        """The rollout engine now holds weights of ``version`` (called when a shipment lands)."""
        with self._cv:
            self.weights_version = max(self.weights_version, version)
            self._cv.notify_all()

    def take(self, step: int) -> tuple[Batch, int]:
        """``step``'s generated rows once every sample finished, and the batches ready or in flight behind it."""
        with self._cv:
            if step not in self._offered and step not in self._ready:
                raise KeyError(f"step {step} was never offered to the rollouter")
            while step not in self._ready and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise self._error
            depth = len(self._ready) - 1 + len(self._offered)
            return self._ready.pop(step), depth

    def snapshot(self) -> RolloutState:
        """The work held for later steps, between two generate calls (the running one finishes first)."""
        with self._cv:
            self._paused = True
            try:
                while self._busy and self._error is None:
                    self._cv.wait()
                if self._error is not None:  # the state may be half updated: a checkpoint must not hold it
                    raise self._error
                return RolloutState(k=self.k, segment_tokens=self.segment_tokens,
                                    weights_version=self.weights_version, segments=self.stats.segments,
                                    pads=dict(self._pads), ready=dict(self._ready),
                                    pending={step: replace(p, done=dict(p.done)) for step, p in self._offered.items()},
                                    flight=[replace(s, pieces={n: list(v) for n, v in s.pieces.items()},
                                                    versions=list(s.versions)) for s in self._flight])
            finally:
                self._paused = False
                self._cv.notify_all()

    def restore(self, state: RolloutState) -> str | None:
        """Take back a :meth:`snapshot` before :meth:`start`; returns why it was not (another mode), else None."""
        if (state.k, state.segment_tokens) != (self.k, self.segment_tokens):
            return (f"its rollout state was generated with max_staleness={state.k}, segment_tokens="
                    f"{state.segment_tokens}, this run uses max_staleness={self.k}, segment_tokens="
                    f"{self.segment_tokens}: the batches it held are dropped and regenerated")
        with self._cv:
            assert not self.started, "restore() before start()"
            self._ready, self._offered = dict(state.ready), dict(state.pending)
            self._flight, self._pads = list(state.flight), dict(state.pads)
            self.stats.segments, self.weights_version = state.segments, state.weights_version
            self.restored = True
        return None

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self.started:
            self._thread.join(timeout=30)

    # ---- the generating thread ----------------------------------------------------------------------
    def _admissible(self, step: int) -> bool:
        return step - self.k <= self.weights_version

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    work = None if self._paused else self._next_work()
                    while work is None and not self._stopped:
                        self._cv.wait()
                        work = None if self._paused else self._next_work()
                    if self._stopped:
                        return
                    assert work is not None
                    self._busy = True
                try:
                    work()
                finally:
                    with self._cv:
                        self._busy = False
                        self._cv.notify_all()
        except BaseException as error:  # kept for the trainer's next take(); the thread ends here
            with self._cv:
                self._error = error
                self._cv.notify_all()

    def _next_work(self) -> Callable[[], None] | None:
        """What to run next (under the lock), or None to wait for weights or prompts."""
        if self.segment_tokens is None or self.turn_segments:
            ready = [s for s in sorted(self._offered) if self._admissible(s)]
            whole = self._generate_turns if self.turn_segments else self._generate_whole
            return partial(whole, ready[0]) if ready else None
        self._admit()
        return self._generate_segment if self._flight else None

    def _generate_whole(self, step: int) -> None:
        with self._cv:
            pending = self._offered[step]
        inputs = pending.rows.select(node_inputs(self.node, pending.rows))
        outputs, version = self._on_rollout(self.node, inputs, self.seed + step)
        versions = torch.full((len(pending.rows),), version, dtype=torch.long)
        tokens = outputs[MASK_FIELD].long()
        with self._cv:
            self.stats.tokens += int(tokens.sum())
            del self._offered[step]
            self._ready[step] = Batch({**pending.rows.union(outputs).tensors, "policy_version": versions,
                                       "token_policy_version": tokens * version},
                                      pending.rows.non_tensors)
            self._cv.notify_all()

    def _generate_turns(self, step: int) -> None:
        """``step``'s trajectories, turn by turn on the rollout's queue (:func:`driver_agent_generate`)."""
        from hybridflow.runtime.agent_rollout import driver_agent_generate, turns_through_generate

        with self._cv:
            pending = self._offered[step]
        calls = itertools.count()  # each batch of turns samples with a seed of its own
        assert self.eos is not None
        eos = self.eos
        pad = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos)
        generate = turns_through_generate(
            self.node, lambda node, inputs: self._on_rollout(node, inputs, self.seed + step + 1_000_003 * next(calls)),
            eos_token_id=eos, pad_token_id=pad)
        outputs = driver_agent_generate(self.node, pending.rows, generate_batch=generate, tokenizer=self.tokenizer,
                                        eos_token_id=eos, pad_token_id=pad, seed=self.seed + step)
        with self._cv:
            self.stats.tokens += int(outputs[MASK_FIELD].sum())
            del self._offered[step]
            self._ready[step] = Batch({**pending.rows.tensors, **outputs.tensors},
                                      {**pending.rows.non_tensors, **outputs.non_tensors})
            self._cv.notify_all()

    def _admit(self) -> None:
        """Fill free slots with rows of the earliest admissible steps, in order (under the lock)."""
        capacity = self.capacity or max((len(p.rows) for p in self._offered.values()), default=0)
        for step in sorted(self._offered):
            pending = self._offered[step]
            if not self._admissible(step):
                return
            while pending.started < len(pending.rows) and len(self._flight) < capacity:
                row = pending.started
                prompt = pending.rows["prompts"][row][pending.rows["prompt_mask"][row].bool()]
                self._flight.append(InFlight(step=step, row=row, rows=pending.rows, prompt=prompt))
                pending.started += 1
            if len(self._flight) >= capacity:
                return

    def _generate_segment(self) -> None:
        flight = list(self._flight)
        budget = self.segment_tokens or self.max_new_tokens
        node = replace(self.node, options=freeze_options({**self.node.options_dict, "max_new_tokens": budget},
                                                         self.node.name))
        seed = self.seed + 1_000_003 * (self.stats.segments + 1) + flight[0].step
        outputs, version = self._on_rollout(node, self._continuation(flight), seed)
        finished = self._extend(flight, outputs, version, budget)
        with self._cv:
            self.stats.segments += 1
            for sequence in finished:
                self._flight.remove(sequence)
                pending = self._offered[sequence.step]
                pending.done[sequence.row] = sequence
                if len(pending.done) == len(pending.rows):
                    del self._offered[sequence.step]
                    self._ready[sequence.step] = self._assemble(pending)
            self._cv.notify_all()

    def _on_rollout(self, node: Node, inputs: Batch, seed: int) -> tuple[Batch, int]:
        """Run ``node`` on the rollout group's queue, behind any weights queued there; returns the outputs and
        the version of the weights they were sampled with (read on that queue, so exact)."""

        versions: list[int] = []
        outcome = self.target.submit_rows(node, inputs, seed,
                                          on_start=lambda: versions.append(self.weights_version)).result()
        with self._cv:
            self.stats.busy_s += outcome.seconds
        return outcome.outputs, versions[0]

    def _continuation(self, flight: list[InFlight]) -> Batch:
        """Each sequence's prompt plus its response so far, left-padded: the generate node's inputs."""
        texts = [torch.cat([s.prompt, s.response()]) for s in flight]
        width = max(len(t) for t in texts)
        pad = int(self._pads.get(RESPONSE_FIELD, 0))
        prompts = torch.full((len(texts), width), pad, dtype=flight[0].prompt.dtype)
        mask = torch.zeros((len(texts), width), dtype=torch.long)
        for i, text in enumerate(texts):
            prompts[i, width - len(text):] = text
            mask[i, width - len(text):] = 1
        rows = [s.rows.slice(s.row, s.row + 1) for s in flight]
        inputs = Batch.concat(rows).select(node_inputs(self.node, rows[0]))
        return Batch({**inputs.tensors, "prompts": prompts, "prompt_mask": mask.to(inputs["prompt_mask"].dtype)},
                     inputs.non_tensors)

    def _extend(self, flight: list[InFlight], outputs: Batch, version: int, budget: int) -> list[InFlight]:
        """Append each sequence's new tokens (at most its remaining budget); returns those that finished."""
        mask = outputs[MASK_FIELD]
        aligned = [name for name, value in outputs.tensors.items() if value.shape == mask.shape]
        if RESPONSE_FIELD not in aligned:
            raise ValueError(f"generate node {self.node.name!r}: partial rollouts continue response-aligned "
                             f"outputs, but {RESPONSE_FIELD!r} is not one of {outputs.keys()}")
        for name in aligned:  # the padding value of each field, for the assembled batch
            off = mask == 0
            if name not in self._pads and bool(off.any()):
                self._pads[name] = float(outputs[name][off][0])
        finished = []
        tokens = 0
        for i, sequence in enumerate(flight):
            new = int(mask[i].sum())
            take = min(new, self.max_new_tokens - sequence.generated)
            for name in aligned:
                sequence.pieces.setdefault(name, []).append(outputs[name][i, :take])
            sequence.versions.append(torch.full((take,), version, dtype=torch.long))
            sequence.generated += take
            tokens += take
            ended = take > 0 and int(outputs[RESPONSE_FIELD][i, take - 1]) == self.eos
            if ended or new < budget or sequence.generated >= self.max_new_tokens:
                finished.append(sequence)
        with self._cv:
            self.stats.tokens += tokens
        return finished

    def _assemble(self, pending: Pending) -> Batch:
        """The step's rows with their generated fields, padded to the longest response (under the lock)."""
        sequences = [pending.done[row] for row in range(len(pending.rows))]
        width = max(max(s.generated for s in sequences), 1)
        fields: dict[str, torch.Tensor] = {}
        for name in sequences[0].pieces:
            sample = sequences[0].pieces[name][0]
            out = torch.full((len(sequences), width), self._pads.get(name, 0), dtype=sample.dtype)
            for i, sequence in enumerate(sequences):
                joined = torch.cat(sequence.pieces[name])
                out[i, :len(joined)] = joined
            fields[name] = out
        versions = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, sequence in enumerate(sequences):
            joined = torch.cat(sequence.versions)
            versions[i, :len(joined)] = joined
        oldest = torch.tensor([int(torch.cat(s.versions).min()) if s.generated else self.weights_version
                               for s in sequences], dtype=torch.long)
        return Batch({**pending.rows.tensors, **fields, "policy_version": oldest, "token_policy_version": versions},
                     pending.rows.non_tensors)


def staleness_metrics(rows: Batch, trainer_version: int, max_staleness: int) -> dict[str, float]:
    """Per-sample staleness (the trainer's version minus the oldest token's) and its histogram."""
    staleness = trainer_version - rows["policy_version"]
    mask = rows[MASK_FIELD].bool()
    token_staleness = (trainer_version - rows["token_policy_version"])[mask].float()
    metrics: dict[str, float] = {"pipeline/staleness_mean": float(staleness.float().mean()),
                                 "pipeline/staleness_max": float(staleness.max()),
                                 "pipeline/token_staleness_mean": float(token_staleness.mean())
                                 if token_staleness.numel() else 0.0}
    versions_per_sample = [len(set(row[m].tolist())) for row, m in zip(rows["token_policy_version"], mask,
                                                                       strict=True)]
    metrics["pipeline/partial_fraction"] = sum(v > 1 for v in versions_per_sample) / max(len(versions_per_sample), 1)
    for lag in range(max_staleness + 1):
        metrics[f"pipeline/staleness_hist/{lag}"] = float((staleness == lag).float().mean())
    return metrics


def pool_metrics(before: RolloutStats, after: RolloutStats, *, seconds: float, waited: float,
                 trained_tokens: int, depth: int) -> dict[str, float]:
    """Idle fraction and tokens/s of each pool over ``seconds``: since the previous step ended, so generation
    between steps (checkpoints, validation) counts too."""
    span = max(seconds, 1e-9)
    return {"pipeline/rollout_idle_fraction": min(max(1 - (after.busy_s - before.busy_s) / span, 0.0), 1.0),
            "pipeline/trainer_idle_fraction": min(waited / span, 1.0),
            "pipeline/rollout_tokens_per_s": (after.tokens - before.tokens) / span,
            "pipeline/trainer_tokens_per_s": trained_tokens / span,
            "pipeline/buffer_depth": float(depth)}

