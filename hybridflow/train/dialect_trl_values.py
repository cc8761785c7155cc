"""The values of TRL 1.16's ``GRPOConfig`` fields whose spelling differs here, as our keys: the conversions that
:mod:`hybridflow.train.dialect_trl`'s rows name (kept apart from the table so that it stays rows only). Each takes
the field's value and the config's other keys (``context``) and returns our keys, or raises
:class:`~hybridflow.train.foreign_keys.Refused` saying what to write instead.
"""

from __future__ import annotations

from typing import Any

from hybridflow.train.foreign_keys import KL_LOSS, NO_KL, Context, Refused


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refused(f"{name} must be a positive integer")
    return value


def batch(value: Any, context: Context) -> dict[str, Any]:
    """TRL counts completions per device per micro step; here data.batch_size counts prompts per step and
    optim.actor.micro_batch_size rows per forward/backward pass per rank."""
    per_device = _int(value, "per_device_train_batch_size")
    accumulation = _int(context.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps")
    devices = _int(context.get("placement.num_gpus", 1), "placement.num_gpus")
    generations = _int(context.get("num_generations", 8), "num_generations (TRL's default 8)")
    per_generation = context.get("steps_per_generation")
    if context.get("generation_batch_size") is not None:
        total = _int(context["generation_batch_size"], "generation_batch_size")
        if total % (per_device * devices):
            raise Refused("generation_batch_size must be a multiple of per_device_train_batch_size x "
                          "placement.num_gpus")
        per_generation = total // (per_device * devices)
    per_generation = _int(per_generation or accumulation, "steps_per_generation")
    completions = per_device * devices * per_generation
    if completions % generations or per_generation % accumulation:
        raise Refused(f"{completions} completions per generation are not whole groups of num_generations="
                      f"{generations} (or steps_per_generation is not a multiple of gradient_accumulation_steps)")
    out = {"optim.actor.micro_batch_size": per_device, "data.batch_size": completions // generations}
    if per_generation // accumulation > 1:
        out["optim.actor.mini_batches"] = per_generation // accumulation
    return out


def with_batch(name: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if "per_device_train_batch_size" not in context:
            raise Refused(f"{name} is translated together with per_device_train_batch_size: give that too "
                          "(TRL's default 8)")
        return {}
    return convert


def max_steps(value: Any, context: Context) -> dict[str, Any]:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return {"steps": value}
    raise Refused("max_steps <= 0 means epochs over the dataset; here give the step count (steps / max_steps)")


def epochs(value: Any, context: Context) -> dict[str, Any]:
    if isinstance(context.get("max_steps"), int) and context["max_steps"] > 0:
        return {}  # TRL itself ignores the epochs when max_steps is set
    raise Refused("here runs count steps: write max_steps (or steps) = num_train_epochs x prompts / "
                  "data.batch_size")


SCHEDULERS = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine",
              "cosine_with_min_lr": "cosine"}


def scheduler(value: Any, context: Context) -> dict[str, Any]:
    if value not in SCHEDULERS:
        raise Refused(f"here optim.actor.lr_scheduler is one of constant, linear, cosine (TRL's {sorted(SCHEDULERS)})")
    return {"optim.actor.lr_scheduler": SCHEDULERS[value]}


def scheduler_kwargs(value: Any, context: Context) -> dict[str, Any]:
    if not value:
        return {}
    if isinstance(value, dict) and set(value) == {"min_lr_rate"}:
        return {"optim.actor.min_lr_ratio": value["min_lr_rate"]}
    raise Refused("only {min_lr_rate: r} (cosine_with_min_lr) has a meaning here: optim.actor.min_lr_ratio")


def warmup(value: Any, context: Context) -> dict[str, Any]:
    if isinstance(value, float) and 0 < value < 1:
        return {"optim.actor.warmup_ratio": value}  # transformers 5 reads a float below 1 as a ratio of the steps
    return {"optim.actor.warmup_steps": value}


def betas(index: int) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        betas = [context.get("adam_beta1", 0.9), context.get("adam_beta2", 0.999)]
        betas[index] = value
        return {"optim.actor.betas": betas}  # both fields give the same pair, so they never clash
    return convert


def report_to(value: Any, context: Context) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    if names in (["none"], []):
        return {"logging.trackers": []}
    if "all" in names:
        raise Refused("name the trackers: tensorboard, wandb, mlflow")
    unknown = sorted(set(names) - {"tensorboard", "wandb", "mlflow"})
    if unknown:
        raise Refused(f"{unknown} have no tracker here; the trackers are tensorboard, wandb, mlflow")
    return {"logging.trackers": names}


def strategy(name: str, target: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if value == "no":
            return {target: 0}
        if value == "steps":
            return {}
        raise Refused(f"only 'steps' (with {name}) or 'no' have a meaning here: {target} counts steps")
    return convert


def every(strategy: str, target: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if context.get(strategy, "steps") == "no" or value is None:
            return {}  # TRL reads the step count only with its strategy at "steps"
        if isinstance(value, float) and value < 1:
            raise Refused(f"a fraction of the run has no meaning here: {target} counts steps")
        return {target: int(value)}
    return convert


def eval_strategy(value: Any, context: Context) -> dict[str, Any]:
    if value == "no":
        return {}
    if value == "steps":
        return {} if context.get("eval_steps") is not None else {"validation.every": int(context.get(
            "logging_steps", 10))}  # TRL evaluates every logging_steps when eval_steps is unset
    raise Refused("only 'steps' (with eval_steps) or 'no' have a meaning here: validation.every counts steps")


def beta(value: Any, context: Context) -> dict[str, Any]:
    algorithm = context["algorithm"]
    if algorithm in KL_LOSS:
        return {"algorithm.options.kl_coef": value}
    if algorithm in NO_KL and value == 0:
        return {}
    raise Refused(f"algorithm {algorithm!r} has no KL loss term (its kl_coef, if any, is a reward penalty); "
                  f"TRL's KL term is grpo's algorithm.options.kl_coef")


def loss_type(value: Any, context: Context) -> dict[str, Any]:
    if value == "grpo":
        return {"algorithm.options.loss_agg": "seq-mean-token-mean"}
    if value == "dapo":
        return {"algorithm.options.loss_agg": "token-mean"}
    if value == "dr_grpo":
        return {"algorithm.name": "dr_grpo"}
    if value == "bnpo":
        raise Refused("bnpo divides by the tokens of each device's micro batch, so an update depends on the micro "
                      "batch size; here every loss_agg is normalised over the whole mini batch (LossNorm), and the "
                      "nearest is loss_type 'dapo' (loss_agg token-mean)")
    raise Refused(f"loss {value!r} is not built in; TRL's grpo, dapo and dr_grpo are (docs/algorithms.md)")


def scale_rewards(value: Any, context: Context) -> dict[str, Any]:
    scale = {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value
    if scale not in ("group", "batch", "none"):
        raise Refused("one of group, batch, none (or true / false)")
    return {"algorithm.options.scale_rewards": scale}


def sequence_level(value: Any, context: Context) -> dict[str, Any]:
    if value == "token":
        return {}
    if value == "sequence":
        return {"algorithm.name": "gspo"}
    raise Refused("'token' or 'sequence' (GSPO: algorithm gspo)")


def use_vllm(value: Any, context: Context) -> dict[str, Any]:
    return {"roles.actor.rollout": "vllm"} if value else {}


def vllm_option(name: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if not context.get("use_vllm") or value is None:
            return {}  # read by TRL only with use_vllm
        return {f"roles.actor.rollout_options.{name}": value}
    return convert


def vllm_correction(value: Any, context: Context) -> dict[str, Any]:
    if not context.get("use_vllm") or not value:
        return {}
    mode = context.get("vllm_importance_sampling_mode", "sequence_mask")
    cap = context.get("vllm_importance_sampling_cap") or context.get("vllm_importance_sampling_clip_max", 3.0)
    corrections = {"token_truncate": "tis", "token_mask": "decoupled"}
    if mode not in corrections:
        raise Refused(f"mode {mode!r}: only the token-level modes are built in (token_truncate: "
                      "rollout_correction tis; token_mask: decoupled); or set it to false")
    return {"algorithm.options.rollout_correction": corrections[mode], "algorithm.options.rollout_is_cap": cap}


def bias_corrected_kl(value: Any, context: Context) -> dict[str, Any]:
    if not value or not context.get("beta"):
        return {}
    raise Refused("the KL term here is not weighted by the importance ratio; set it to false to match, or beta 0")


def eval_first(value: Any, context: Context) -> dict[str, Any]:
    return {"validation.before_train": value}


def disable_tqdm(value: Any, context: Context) -> dict[str, Any]:
    return {} if value is None else {"logging.progress": not value}
