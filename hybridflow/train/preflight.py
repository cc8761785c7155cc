"""Checks a run makes before it writes, loads or trains anything (well under a second on a laptop).

Everything here is decidable from the config and the files it names: numeric ranges, that model
directories and data files exist, the reward functions load and take an accepted signature, the graph
builds, and a given plan holds its roles. What needs the data (prompt lengths, tokenizer coverage, the
plan, made once with the real prompt lengths) is checked right after it loads, before anything is written
and before any model loads. Each error names the config key and the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridflow.data.rewards import RewardScorer
from hybridflow.data.splits import paths
from hybridflow.graph import Graph, Op
from hybridflow.planner import Plan
from hybridflow.planner.cluster import MAX_CLUSTER_GPUS
from hybridflow.planner.settings import MAX_EPOCHS, MAX_STEP_ROWS
from hybridflow.train import setup
from hybridflow.train.bounds import check_sizes
from hybridflow.train.config import OptimConfig, TrainConfig
from hybridflow.train.file_checks import model_config, safetensors_problem
from hybridflow.train.schema import INT64_MAX


def check_config(config: TrainConfig, graph: Graph, plan: Plan | None = None) -> None:
    """Raise ``ValueError``/``FileNotFoundError``/``KeyError`` naming the first bad key of ``config``."""
    check_ranges(config)
    check_node_options(graph)
    check_step_rows(config, graph)
    check_model_paths(config)
    check_sizes(config, graph)  # upper bounds of size-like keys, before anything is allocated
    check_rollouts(config)
    check_files(config)
    check_validation(config, graph)
    setup.reward_scorer(config, tokenizer=None)  # loads each function and checks its signature
    if plan is not None:
        setup.check_role_entries(config, graph, plan)


def check_validation(config: TrainConfig, graph: Graph) -> None:
    """Validation samples with the graph's generate node: a graph without one (DPO's, offline) has nothing to
    validate with, so asking for validation is refused now, not after the first steps."""
    asked = [key for key, value in (("validation.every", config.validation.every),
                                    ("validation.before_train", config.validation.before_train)) if value]
    if asked and not any(node.op is Op.GENERATE for node in graph.nodes):
        raise ValueError(f"config key {asked[0]!r} asks for validation, which samples with the graph's generate "
                         f"node, but the {graph.name} graph has none (it trains offline on the dataset's rows); "
                         "drop the key")


def check_ranges(config: TrainConfig) -> None:
    """Counts are positive, rates positive and finite: a zero or negative value is refused, never replaced."""
    model, data = config.model, config.data
    _at_least("model.sft_steps", model.sft_steps, 0)
    _at_least("model.sft_batch_size", model.sft_batch_size, 1)
    _positive("model.sft_lr", model.sft_lr)
    _at_least("data.batch_size", data.batch_size, 1)
    _at_least("data.num_examples", data.num_examples, 1)
    _positive("data.reward_timeout_s", data.reward_timeout_s)
    _at_least("seed", config.seed, 0)
    if config.placement.num_gpus > MAX_CLUSTER_GPUS:
        gpus = config.placement.num_gpus
        raise ValueError(f"config key 'placement.num_gpus'={gpus}: {gpus} GPUs exceed the planner's bound of "
                         f"{MAX_CLUSTER_GPUS} GPUs; give the GPUs the run has")
    if isinstance(data.reward, list) and not data.reward:
        raise ValueError("config key 'data.reward' is an empty list; name at least one reward function (e.g. "
                         "data.reward=math), or drop the key to use the built-in task's rule")
    for name, optim in (("optim.actor", config.optim.actor), ("optim.critic", config.optim.critic)):
        _check_optim(name, optim)


def check_step_rows(config: TrainConfig, graph: Graph) -> None:
    """The rows of a step (``data.batch_size`` prompts x n samples) are bounded, and each trainable role's
    ``mini_batches`` splits them into non-empty optimizer steps (more would train on padding rows only);
    ``stream_chunks`` holds whole prompts, so at most ``data.batch_size`` of them."""
    prompts, samples = config.data.batch_size, graph.samples_per_prompt
    if graph.reads_pairs:
        check_pair_rows(config)
        samples = 2  # a preference pair is two rows
    rows = prompts * samples
    if rows > MAX_STEP_ROWS:
        raise ValueError(f"a step of data.batch_size={prompts} prompts x n={samples} samples is {rows} rows, more "
                         f"than {MAX_STEP_ROWS}; lower data.batch_size or algorithm.options.n")
    for name, optim in (("optim.actor", config.optim.actor), ("optim.critic", config.optim.critic)):
        if optim.mini_batches > rows:
            raise ValueError(f"config key '{name}.mini_batches'={optim.mini_batches} exceeds the {rows} rows of a "
                             f"step (data.batch_size={prompts} x n={samples}): each optimizer step needs rows of its "
                             f"own; use at most {rows}, or raise data.batch_size")
    if config.pipeline.stream_chunks > prompts:
        raise ValueError(f"config key 'pipeline.stream_chunks'={config.pipeline.stream_chunks} exceeds the "
                         f"data.batch_size={prompts} prompts of a step (a chunk holds whole prompts); use at most "
                         f"{prompts}")


def check_pair_rows(config: TrainConfig) -> None:
    """A graph on preference pairs (DPO) needs each pair's two rows in one micro batch: every optimizer step holds
    whole pairs (``data.batch_size`` pairs a step, a multiple of ``mini_batches``) and a fixed micro batch is an even
    number of rows."""
    pairs, optim = config.data.batch_size, config.optim.actor
    if pairs % optim.mini_batches:
        raise ValueError(f"config key 'optim.actor.mini_batches'={optim.mini_batches} does not divide the "
                         f"data.batch_size={pairs} preference pairs of a step; an optimizer step must hold whole pairs")
    if optim.micro_batch_size is not None and optim.micro_batch_size % 2:
        raise ValueError(f"config key 'optim.actor.micro_batch_size'={optim.micro_batch_size} is odd; a preference "
                         "pair's two rows must share a micro batch, so use an even number of rows")


MAX_OPTIMIZER_STEPS = 1 << 16  # per role and step: epochs x mini_batches


def _check_optim(name: str, optim: OptimConfig) -> None:
    _positive(f"{name}.lr", optim.lr)
    if optim.epochs > MAX_EPOCHS:  # each epoch is a whole update's forward, backward and optimizer steps
        raise ValueError(f"config key '{name}.epochs'={optim.epochs} exceeds {MAX_EPOCHS} passes over a step's "
                         f"samples; use at most {MAX_EPOCHS} (PPO recipes use 1-10)")
    if optim.epochs * optim.mini_batches > MAX_OPTIMIZER_STEPS:
        raise ValueError(f"config keys '{name}.epochs'={optim.epochs} x '{name}.mini_batches'={optim.mini_batches} "
                         f"are {optim.epochs * optim.mini_batches} optimizer steps per training step, more than "
                         f"{MAX_OPTIMIZER_STEPS}; lower {name}.mini_batches or {name}.epochs")
    if optim.micro_batch_size is not None:
        _at_least(f"{name}.micro_batch_size", optim.micro_batch_size, 1)
    if optim.weight_decay < 0 or not math.isfinite(optim.weight_decay):
        raise ValueError(f"config key '{name}.weight_decay'={optim.weight_decay} must be a finite number >= 0")
    if not optim.grad_clip > 0 or not math.isfinite(optim.grad_clip):
        raise ValueError(f"config key '{name}.grad_clip'={optim.grad_clip} must be a finite number > 0")
    if not all(0 <= beta < 1 for beta in optim.betas):
        raise ValueError(f"config key '{name}.betas'={list(optim.betas)} must be two numbers in [0, 1)")


# Node options that are a count, a weight or a ratio whatever the algorithm: a negative value is a typo.
NON_NEGATIVE_OPTIONS = ("kl_coef", "clip_ratio", "clip_ratio_high", "clip_ratio_low", "max_new_tokens", "n", "top_k")


def check_node_options(graph: Graph) -> None:
    """Numeric node options are finite, the non-negative ones non-negative, and each generate node's sampling
    options make valid :class:`SamplingParams` (checked here, not first on a worker after the model loaded)."""
    import dataclasses

    from hybridflow.runtime.protocols import SamplingParams

    sampling = {f.name: f.type for f in dataclasses.fields(SamplingParams)}
    sampling.pop("seed")
    for node in graph.nodes:
        options = node.options_dict
        for name, value in options.items():
            key = f"algorithm.options.{name} (node {node.name!r})"
            wanted = sampling.get(name) if node.op is Op.GENERATE else None
            if wanted is not None or name in NON_NEGATIVE_OPTIONS:
                _option_type(key, value, wanted or "float")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{key}={value} must be a finite number")
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
                raise ValueError(f"{key}={value} does not fit a 64-bit integer")
            if name in NON_NEGATIVE_OPTIONS and isinstance(value, int | float) and value < 0:
                raise ValueError(f"{key}={value} must be >= 0")
        if node.op is Op.GENERATE:
            try:
                SamplingParams(**{name: value for name,
                                  value in options.items() if name in sampling})  # type: ignore[arg-type]
            except ValueError as err:
                raise ValueError(f"node {node.name!r}: {err} (algorithm.options)") from err


def _option_type(key: str, value: Any, wanted: Any) -> None:
    """``value`` has the type a sampling option or a numeric option takes (``wanted``: a type or its name)."""
    name = wanted if isinstance(wanted, str) else wanted.__name__
    if name == "bool":
        ok = isinstance(value, bool)
    elif name == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:  # float: an int is a float too
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise TypeError(f"{key}={value!r} must be a {'number' if name == 'float' else name}, got "
                        f"{type(value).__name__}")


def check_model_paths(config: TrainConfig) -> None:
    """``model.path`` and ``roles.*.model`` are local HF model directories; ``model.name`` a built-in tiny model."""
    from hybridflow.models.tiny import TINY_CONFIGS

    if config.model.path:
        _model_dir("model.path", config.model.path)
        _tokenizer_files("model.path", config.model.path)
    elif config.model.name not in TINY_CONFIGS:
        raise ValueError(f"config key 'model.name'={config.model.name!r} is not a built-in tiny model "
                         f"({sorted(TINY_CONFIGS)}); for another model set model.path to a local HF directory")
    for role, entry in config.roles.items():
        if entry.model:
            _model_dir(f"roles.{role}.model", entry.model)


def check_rollouts(config: TrainConfig) -> None:
    """Each ``roles.*.rollout`` names a registered rollout engine (or loads one as ``file.py:factory``)."""
    from hybridflow.registry import RegistryError
    from hybridflow.runtime.engines import rollout_factory
    from hybridflow.runtime.protocols import DEFAULT_ROLLOUT

    for role, entry in config.roles.items():
        if entry.rollout == DEFAULT_ROLLOUT:  # always there: looking it up would import every backend
            continue
        try:
            rollout_factory(entry.rollout, role=role)
        except (RegistryError, ImportError, AttributeError, FileNotFoundError, TypeError, ValueError) as err:
            raise KeyError(f"config key 'roles.{role}.rollout'={entry.rollout!r}: {err}") from err


def _model_dir(key: str, value: str) -> None:
    path = Path(value).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"config key {key!r}={value!r}: no such directory; give a local HF model directory "
                                "(with config.json; models are never downloaded: download one first, e.g. "
                                "`huggingface-cli download NAME --local-dir DIR`)")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"config key {key!r}={value!r} is not an HF model directory (no config.json in it)")
    model_config(key, path)
    for weights in sorted(path.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem is not None:
            raise ValueError(f"config key {key!r}: {weights} {problem}; copy the model directory again (or "
                             "re-download it)")


# Files a Hugging Face tokenizer is saved as (fast, sentencepiece, BPE and WordPiece vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def _tokenizer_files(key: str, value: str) -> None:
    path = Path(value).expanduser()
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"config key {key!r}={value!r} has no tokenizer files (none of "
                                f"{list(TOKENIZER_FILES)}); the policy's prompts would encode to nothing. Save the "
                                "tokenizer beside the weights (tokenizer.save_pretrained(DIR))")


def check_vocabulary(config: TrainConfig, tokenizer: Any) -> None:
    """Every token id the policy's tokenizer can produce has a row in the model's embedding (``vocab_size`` of
    ``model.path``'s config.json); a larger tokenizer would index past it on the first forward pass."""
    if not config.model.path:
        return  # a built-in tiny model is sized by the tokenizer
    path = Path(config.model.path).expanduser()
    found = model_config("model.path", path)
    vocab = found.get("vocab_size", (found.get("text_config") or {}).get("vocab_size"))
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        return
    produced = len(tokenizer)
    if produced > vocab:
        raise ValueError(f"config key 'model.path'={config.model.path!r}: its tokenizer produces token ids up to "
                         f"{produced - 1}, but {path / 'config.json'} has vocab_size={vocab}; the model has no "
                         "embedding for ids >= vocab_size. Use the tokenizer the model was trained with (or resize "
                         "the model's embeddings and save it again)")


def check_files(config: TrainConfig) -> None:
    """Data and plan files exist and are readable; a plan file is a valid plan."""
    named = [(key if isinstance(value, str) else f"{key}[{i}]", item)
             for key, value in (("data.path", config.data.path), ("data.val_path", config.data.val_path))
             for i, item in enumerate(paths(value))]
    for key, value in (*named, ("plan_file", config.placement.plan_file)):
        if value is None:
            continue
        path = Path(value).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"config key {key!r}={value!r}: no such file or directory")
        if path.is_file():
            try:
                path.open("rb").close()
            except PermissionError as err:
                raise PermissionError(f"config key {key!r}={value!r}: permission denied; make it readable") from err
    if config.placement.plan_file:
        try:
            Plan.from_json(Path(config.placement.plan_file).read_text())
        except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
            what = "not JSON" if isinstance(err, json.JSONDecodeError) else "not a plan"
            raise ValueError(f"config key 'placement.plan_file'={config.placement.plan_file!r} is {what} ({err}); "
                             "write one with `hybridflow plan ... --json`") from err


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"config key {key!r}={value} must be >= {low}")


def _positive(key: str, value: float) -> None:
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"config key {key!r}={value} must be a finite number > 0")


COVERAGE_ROWS = 4096  # prompts checked for characters the tokenizer cannot represent (all rows up to this)


def model_context(config: TrainConfig) -> int | None:
    """The policy's context length (``max_position_embeddings``), read without loading weights; None if unknown."""
    from hybridflow.models.tiny import TINY_CONFIGS

    if config.model.path:
        path = Path(config.model.path).expanduser() / "config.json"
        found = json.loads(path.read_text()).get("max_position_embeddings") if path.is_file() else None
        return int(found) if isinstance(found, int) else None
    sizes = TINY_CONFIGS.get(config.model.name, ("", {}))[1]
    return sizes.get("max_position_embeddings")


def check_prompts(config: TrainConfig, graph: Graph, records: list[dict[str, Any]], tokenizer: Any,
                  longest: int) -> None:
    """Prompts fit the model's context with the longest response, and use only characters the tokenizer knows.

    Over-long prompts are refused (or dropped and counted with ``data.max_prompt_length``, before this check).
    """
    context = model_context(config)
    response = graph.max_new_tokens if any(node.op is Op.GENERATE for node in graph.nodes) else 0
    if context is not None and longest + response > context:
        raise ValueError(f"the longest prompt has {longest} tokens; with max_new_tokens={response} that exceeds the "
                         f"model's context of {context} tokens (max_position_embeddings); set data.max_prompt_length="
                         f"{max(1, context - response)} to drop longer prompts (they are counted), or lower "
                         "algorithm.options.max_new_tokens")
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return
    for index, record in enumerate(records[:COVERAGE_ROWS]):
        prompt = str(record["prompt"])
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if unk in ids:
            missing = sorted({char for char in prompt if unk in tokenizer(char, add_special_tokens=False)["input_ids"]})
            raise ValueError(f"prompt of row {index} ({prompt[:60]!r}) has characters the tokenizer maps to "
                             f"{tokenizer.unk_token!r}: {missing[:10]}; the policy cannot read them. Use a model "
                             "(model.path) whose tokenizer covers them, or clean the data")


def probe_rewards(config: TrainConfig, records: list[dict[str, Any]], tokenizer: Any,
                  scorer: RewardScorer | None = None) -> None:
    """Score the first row once, its ground truth as the response, with the run's ``scorer`` (its worker
    processes and ``data.reward_timeout_s``; default: a scorer of its own): a reward function that returns a
    string, None, a list or a non-finite number, raises, exits or hangs is refused now (exit 2), not after the
    model loaded."""
    from hybridflow.data.records import GroundTruth, reward_target
    from hybridflow.data.reward_functions import Sample
    from hybridflow.runtime.errors import RewardFunctionError

    if not records:
        return
    record = records[0]
    truth = reward_target(record)
    context = truth if isinstance(truth, GroundTruth) else None
    prompt = str(record["prompt"])
    sample = Sample(index=0, prompt=prompt, prompt_text=prompt, response=str(truth), ground_truth=str(truth),
                    response_ids=tokenizer(str(truth), add_special_tokens=False)["input_ids"])
    if context is not None:  # a GroundTruth of "" (a prompt-only row) is falsy but still carries its columns
        sample = replace(sample, prompt=context.prompt or prompt, data_source=context.data_source,
                         extra_info=context.extra_info, columns=context.columns)
    used = scorer or setup.reward_scorer(config, tokenizer)
    try:
        used.score([sample], track=False)
    except RewardFunctionError as err:
        raise ValueError(f"{err} (checked before training, on row 0 with its ground truth as the response)") from err
    finally:
        if scorer is None:
            used.close()
