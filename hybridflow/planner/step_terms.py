"""What a training step does beside its graph's GPU nodes, each term modelled with its source.

The planner used to add one fitted constant per step (``step_overhead_s``, 47.6 s in the first shipped
calibration) for all of this; a constant that long dominated short runs and explained nothing. Instead:

- **Rule-based rewards** (:func:`reward_seconds`): a reward function on the driver detokenises every sample
  (prompt and response: verl's ``NaiveRewardManager``/``DAPORewardManager`` decode both, hybridflow's scorer
  too) and scores the text, sample by sample, in ``RunSettings.reward_workers`` processes (verl: one, its
  driver loop; hybridflow: its reward pool's workers). ``DETOKENIZE_TOKEN_S`` and ``RULE_SCORE_S`` are measured
  by ``benchmarks/step_terms.py`` (hybridflow's ``decode_responses`` and ``math_reward``, the same work as verl's
  ``math_dapo``/``gsm8k`` ``compute_score``). It is the driver node's time in the schedule.
- **An LLM judge's driver nodes** (:func:`driver_seconds`): the node rendering its prompts decodes each row's
  prompt and response, renders the template around them (``TEMPLATE_RENDER_S`` a row) and encodes the judge prompt
  in the judge's tokenizer (``TOKENIZE_TOKEN_S`` a token, every token the judge prefills); the node parsing its
  verdicts decodes each verdict's budget of tokens. Measured by ``benchmarks/step_terms.py``.
- **Validation** (:func:`validation_seconds`): every ``1 / validations_per_step`` steps, a generate pass over
  the validation prompts on the policy's rollout engine (woken again, weights refreshed) and their rewards.
  verl runs it inside its step timer (``ray_trainer.fit``: ``testing`` within ``step``), hybridflow after it.
- **Checkpoints** (:func:`checkpoint_seconds`): every ``1 / checkpoints_per_step`` steps each trainable role
  writes its weights and optimizer states; the machines it spans write in parallel, each at
  ``CHECKPOINT_WRITE_BYTES_S``.
- **Data loading and logging**: verl's step timer opens after its dataloader yields and closes before
  ``logger.log``; hybridflow's (``train/loop.py``) holds ``loader.batch``, which hands over prompts tokenised
  once at start. Neither is priced.

A framework's timer decides which of these its measured ``step`` holds: the run settings say which the run
does (``validations_per_step``, ``checkpoints_per_step`` 0 when the measured step leaves them out).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybridflow.graph import NodeLoad, Op
from hybridflow.graph.workload import node_load
from hybridflow.planner.costs import DRIVER_SECONDS_PER_ROW, static_bytes
from hybridflow.planner.rollout import generate_cost
from hybridflow.planner.weight_moves import engine_switch, weight_sync

if TYPE_CHECKING:
    from hybridflow.planner.assemble import Placement
    from hybridflow.planner.problem import Problem

# benchmarks/step_terms.py on the project's 2-core EPYC (shared; median of 5 interleaved repeats, 256 responses of
# ~1,640 tokens, byte-level BPE): 0.89 us per detokenised token, 78 us per math_reward call.
DETOKENIZE_TOKEN_S = 0.9e-6
RULE_SCORE_S = 78e-6
# benchmarks/step_terms.py on a 2-core Intel Xeon KVM guest (2026-12-07, load ~2.5; detokenising measured 0.22 us a
# token there): the pointwise template rendered around a ~1,640-token response, 11.7 us a row; the rendered text
# encoded by the byte-level BPE, 1.0 us a token (the tiny models' character tokenizer: 1.3-1.8 us).
TEMPLATE_RENDER_S = 11.7e-6
TOKENIZE_TOKEN_S = 1.0e-6
# Checkpoint writes per machine: an 8B model's weights and Adam states (~100 GB) take ~6 min on one 8xH100 machine
# (pytorch/torchtitan#1301: 0.27 GB/s) and over 4 min (pytorch/pytorch#104081, HSDP: ~0.4 GB/s); torch.save with
# fsync measured 0.24 GB/s here (benchmarks/step_terms.py). Shards of all of a machine's ranks share its storage.
CHECKPOINT_WRITE_BYTES_S = 0.3e9
# What a checkpoint holds per trainable weight: the weights in 16-bit and fp32 master weights + Adam m, v (verl's
# FSDP and Megatron checkpoints: model, optimizer, extra; the extra state is small).
CHECKPOINT_BYTES_PER_PARAM = 2 + 12


def reward_seconds(rows: int, tokens_per_row: float, workers: int) -> float:
    """Scoring ``rows`` samples of ``tokens_per_row`` (prompt + response) tokens with a rule, ``workers`` at a time."""
    return rows * (RULE_SCORE_S + tokens_per_row * DETOKENIZE_TOKEN_S) / max(workers, 1)


def driver_seconds(problem: Problem, node: str) -> float:
    """A driver node's seconds: a rule-based reward (:func:`reward_seconds`), an LLM judge's prompts or verdicts (the
    module), else a vector op over the rows."""
    graph, workload = problem.graph, problem.workload
    rows = workload.sequences(graph)
    if graph.node(node).op is Op.SCORE:
        return reward_seconds(rows, workload.prompt_len + workload.response_len, problem.settings.reward_workers)
    for generate in graph.nodes:
        if generate.op is not Op.GENERATE or generate.port_inputs()["prompts"] not in graph.producers:
            continue
        if graph.producers[generate.port_inputs()["prompts"]] == node:  # renders the judge's prompts
            judged = node_load(graph, generate, workload).prompt_tokens
            return (rows * (TEMPLATE_RENDER_S + (workload.prompt_len + workload.response_len) * DETOKENIZE_TOKEN_S)
                    + judged * TOKENIZE_TOKEN_S)
        if generate.name in graph.predecessors(node):  # decodes and parses the judge's verdicts
            return rows * (generate.max_new_tokens * DETOKENIZE_TOKEN_S + DRIVER_SECONDS_PER_ROW)
    return rows * DRIVER_SECONDS_PER_ROW


def validation_seconds(problem: Problem, groups: Sequence[Placement]) -> float:
    """One validation pass, per step: a generate of the validation rows on the first generating role's group (after
    a refresh and wake of its engine, as a fresh rollout) and a rule reward on them, times the validation rate."""
    run = problem.settings
    if not run.validations_per_step or not run.validation_prompts:
        return 0.0
    for group in groups:
        for layout in group.layout.layouts:
            role = problem.role(layout.role)
            if not role.generate:
                continue
            rows = run.validation_prompts * run.validation_samples
            prompt = problem.workload.prompt_len
            image = problem.workload.image_tokens if role.model.vision is not None else 0
            load = NodeLoad("validation", Op.GENERATE, rows, run.validation_prompts * (prompt + image),
                            rows * problem.workload.response_len, run.validation_prompts * image, image)
            resident = static_bytes(role.model, role.kind, layout, group.shape)
            seconds = generate_cost(role.model, load, prompt, layout, group.shape, resident).seconds
            if role.update:  # a colocated engine slept after the step's rollout and takes the new weights
                seconds += weight_sync(role.model, layout, group.shape)[0]
                seconds += engine_switch(role.model, role.kind, layout, group.shape)
            seconds += reward_seconds(rows, prompt + problem.workload.response_len, run.reward_workers)
            return seconds * run.validations_per_step
    return 0.0


def checkpoint_seconds(problem: Problem, groups: Sequence[Placement]) -> float:
    """Writing every trainable role's checkpoint (``CHECKPOINT_BYTES_PER_PARAM`` per trained weight: a LoRA role's
    adapter), its machines in parallel at ``CHECKPOINT_WRITE_BYTES_S`` each, times the checkpoint rate."""
    if not problem.settings.checkpoints_per_step:
        return 0.0
    cluster, seconds = problem.cluster, 0.0
    for group in groups:
        machines = len({cluster.machine_index(gpu) for gpu in group.gpus})
        for layout in group.layout.layouts:
            role = problem.role(layout.role)
            if role.kind.trainable and role.update:
                trained = role.model.adapter_params if role.model.adapter is not None else role.model.params
                trained += role.model.trained_vision_params
                seconds += trained * CHECKPOINT_BYTES_PER_PARAM / (machines * CHECKPOINT_WRITE_BYTES_S)
    return seconds * problem.settings.checkpoints_per_step


def step_terms(problem: Problem, groups: Sequence[Placement]) -> dict[str, float]:
    """Seconds per step the graph's schedule does not hold: amortised validation and checkpoints."""
    return {"validation": validation_seconds(problem, groups), "checkpoint": checkpoint_seconds(problem, groups)}
