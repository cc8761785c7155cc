"""TRL 1.16's ``GRPOConfig`` fields (its own and those it inherits from ``transformers.TrainingArguments``) as
config keys: each top-level field is renamed to ours, accepted as a no-op or refused saying why
(:mod:`hybridflow.train.aliases`). Fields that are already our keys (``output_dir``, ``seed``) need no entry.
tests/train/test_dialects.py checks every field of the installed ``GRPOConfig`` is classified here.
"""

from __future__ import annotations

from typing import Any

from hybridflow.train.foreign_keys import ANY, OFF, Context, ForeignKey, Refused

SOURCE = "TRL"
KL_LOSS = ("grpo", "dr_grpo", "gspo")  # algorithms whose kl_coef is a loss term with the k3 estimator, as TRL's
NO_KL = ("dapo", "grpo_no_ref")  # algorithms without a reference


def _to(target: str, meaning: str, why: str = "") -> ForeignKey:
    return ForeignKey(source=SOURCE, meaning=meaning, target=target, why=why)


def _conv(convert: Any, meaning: str, why: str = "", first: bool = False) -> ForeignKey:
    return ForeignKey(source=SOURCE, meaning=meaning, convert=convert, why=why, first=first)


def _noop(meaning: str, why: str, harmless: Any = ANY) -> ForeignKey:
    return ForeignKey(source=SOURCE, meaning=meaning, harmless=harmless, why=why)


def _no(meaning: str, why: str, harmless: Any = OFF) -> ForeignKey:
    return ForeignKey(source=SOURCE, meaning=meaning, harmless=harmless, why=why)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refused(f"{name} must be a positive integer")
    return value


def _batch(value: Any, context: Context) -> dict[str, Any]:
    """TRL counts completions per device per micro step; here data.batch_size counts prompts per step and
    actor.micro_batch_size rows per forward/backward pass per rank."""
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
    out = {"actor.micro_batch_size": per_device, "data.batch_size": completions // generations}
    if per_generation // accumulation > 1:
        out["actor.mini_batches"] = per_generation // accumulation
    return out


def _with_batch(name: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if "per_device_train_batch_size" not in context:
            raise Refused(f"{name} is translated together with per_device_train_batch_size: give that too "
                          "(TRL's default 8)")
        return {}
    return convert


def _max_steps(value: Any, context: Context) -> dict[str, Any]:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return {"steps": value}
    raise Refused("max_steps <= 0 means epochs over the dataset; here give the step count (steps / max_steps)")


def _epochs(value: Any, context: Context) -> dict[str, Any]:
    if isinstance(context.get("max_steps"), int) and context["max_steps"] > 0:
        return {}  # TRL itself ignores the epochs when max_steps is set
    raise Refused("here runs count steps: write max_steps (or steps) = num_train_epochs x prompts / "
                  "data.batch_size")


SCHEDULERS = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine",
              "cosine_with_min_lr": "cosine"}


def _scheduler(value: Any, context: Context) -> dict[str, Any]:
    if value not in SCHEDULERS:
        raise Refused(f"here actor.lr_scheduler is one of constant, linear, cosine (TRL's {sorted(SCHEDULERS)})")
    return {"actor.lr_scheduler": SCHEDULERS[value]}


def _scheduler_kwargs(value: Any, context: Context) -> dict[str, Any]:
    if not value:
        return {}
    if isinstance(value, dict) and set(value) == {"min_lr_rate"}:
        return {"actor.min_lr_ratio": value["min_lr_rate"]}
    raise Refused("only {min_lr_rate: r} (cosine_with_min_lr) has a meaning here: actor.min_lr_ratio")


def _warmup(value: Any, context: Context) -> dict[str, Any]:
    if isinstance(value, float) and 0 < value < 1:
        return {"actor.warmup_ratio": value}  # transformers 5 reads a float below 1 as a ratio of the steps
    return {"actor.warmup_steps": value}


def _betas(index: int) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        betas = [context.get("adam_beta1", 0.9), context.get("adam_beta2", 0.999)]
        betas[index] = value
        return {"actor.betas": betas}  # both fields give the same pair, so they never clash
    return convert


def _report_to(value: Any, context: Context) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    if names in (["none"], []):
        return {"logging.trackers": []}
    if "all" in names:
        raise Refused("name the trackers: tensorboard, wandb, mlflow")
    unknown = sorted(set(names) - {"tensorboard", "wandb", "mlflow"})
    if unknown:
        raise Refused(f"{unknown} have no tracker here; the trackers are tensorboard, wandb, mlflow")
    return {"logging.trackers": names}


def _strategy(name: str, target: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if value == "no":
            return {target: 0}
        if value == "steps":
            return {}
        raise Refused(f"only 'steps' (with {name}) or 'no' have a meaning here: {target} counts steps")
    return convert


def _every(strategy: str, target: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if context.get(strategy, "steps") == "no" or value is None:
            return {}  # TRL reads the step count only with its strategy at "steps"
        if isinstance(value, float) and value < 1:
            raise Refused(f"a fraction of the run has no meaning here: {target} counts steps")
        return {target: int(value)}
    return convert


def _eval_strategy(value: Any, context: Context) -> dict[str, Any]:
    if value == "no":
        return {}
    if value == "steps":
        return {} if context.get("eval_steps") is not None else {"validation.every": int(context.get(
            "logging_steps", 10))}  # TRL evaluates every logging_steps when eval_steps is unset
    raise Refused("only 'steps' (with eval_steps) or 'no' have a meaning here: validation.every counts steps")


def _beta(value: Any, context: Context) -> dict[str, Any]:
    algorithm = context["algorithm"]
    if algorithm in KL_LOSS:
        return {"algorithm_options.kl_coef": value}
    if algorithm in NO_KL and value == 0:
        return {}
    raise Refused(f"algorithm {algorithm!r} has no KL loss term (its kl_coef, if any, is a reward penalty); "
                  f"TRL's KL term is grpo's algorithm_options.kl_coef")


def _loss_type(value: Any, context: Context) -> dict[str, Any]:
    if value == "grpo":
        return {"algorithm_options.loss_agg": "seq-mean-token-mean"}
    if value == "dapo":
        return {"algorithm_options.loss_agg": "token-mean"}
    if value == "dr_grpo":
        return {"algorithm": "dr_grpo"}
    if value == "bnpo":
        raise Refused("bnpo divides by the tokens of each device's micro batch, so an update depends on the micro "
                      "batch size; here every loss_agg is normalised over the whole mini batch (LossNorm), and the "
                      "nearest is loss_type 'dapo' (loss_agg token-mean)")
    raise Refused(f"loss {value!r} is not built in; TRL's grpo, dapo and dr_grpo are (docs/algorithms.md)")


def _scale_rewards(value: Any, context: Context) -> dict[str, Any]:
    scale = {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value
    if scale not in ("group", "batch", "none"):
        raise Refused("one of group, batch, none (or true / false)")
    return {"algorithm_options.scale_rewards": scale}


def _sequence_level(value: Any, context: Context) -> dict[str, Any]:
    if value == "token":
        return {}
    if value == "sequence":
        return {"algorithm": "gspo"}
    raise Refused("'token' or 'sequence' (GSPO: algorithm gspo)")


def _use_vllm(value: Any, context: Context) -> dict[str, Any]:
    return {"roles.actor.rollout": "vllm"} if value else {}


def _vllm_option(name: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if not context.get("use_vllm") or value is None:
            return {}  # read by TRL only with use_vllm
        return {f"roles.actor.rollout_options.{name}": value}
    return convert


def _vllm_correction(value: Any, context: Context) -> dict[str, Any]:
    if not context.get("use_vllm") or not value:
        return {}
    mode = context.get("vllm_importance_sampling_mode", "sequence_mask")
    cap = context.get("vllm_importance_sampling_cap") or context.get("vllm_importance_sampling_clip_max", 3.0)
    corrections = {"token_truncate": "tis", "token_mask": "decoupled"}
    if mode not in corrections:
        raise Refused(f"mode {mode!r}: only the token-level modes are built in (token_truncate: "
                      "rollout_correction tis; token_mask: decoupled); or set it to false")
    return {"algorithm_options.rollout_correction": corrections[mode], "algorithm_options.rollout_is_cap": cap}


def _bias_corrected_kl(value: Any, context: Context) -> dict[str, Any]:
    if not value or not context.get("beta"):
        return {}
    raise Refused("the KL term here is not weighted by the importance ratio; set it to false to match, or beta 0")


def _eval_first(value: Any, context: Context) -> dict[str, Any]:
    return {"validation.before_train": value}


def _disable_tqdm(value: Any, context: Context) -> dict[str, Any]:
    return {} if value is None else {"logging.progress": not value}


_MEMORY = "memory or speed only: the numbers trained are the same"
_LOGGING = "what the console or a tracker shows; metrics.jsonl has every step here"
_HUB = "read only with push_to_hub (refused unless false)"

TRL: dict[str, ForeignKey] = {
    "per_device_train_batch_size": _conv(_batch, "completions per device per micro step", "data.batch_size (prompts "
                                         "per step) = this x placement.num_gpus x steps_per_generation / "
                                         "num_generations, actor.micro_batch_size = this"),
    "num_train_epochs": _conv(_epochs, "passes over the dataset", "accepted with max_steps > 0 (TRL then ignores "
                              "it); else refused: write max_steps"),
    "max_steps": _conv(_max_steps, "optimizer steps", "steps"),
    "learning_rate": _to("actor.lr", "the learning rate"),
    "lr_scheduler_type": _conv(_scheduler, "learning-rate schedule", "actor.lr_scheduler (constant, linear, cosine)"),
    "lr_scheduler_kwargs": _conv(_scheduler_kwargs, "scheduler options", "{min_lr_rate: r} is actor.min_lr_ratio"),
    "warmup_steps": _conv(_warmup, "linear warmup steps (a float < 1: a ratio)", "actor.warmup_steps / "
                          "actor.warmup_ratio"),
    "optim": _no("the optimizer", "the optimizer here is torch AdamW", ("adamw_torch", "adamw_torch_fused")),
    "optim_args": _no("optimizer options", "not supported: the optimizer is torch AdamW with actor.* settings"),
    "weight_decay": _to("actor.weight_decay", "AdamW weight decay"),
    "adam_beta1": _conv(_betas(0), "AdamW beta1", "actor.betas[0]"),
    "adam_beta2": _conv(_betas(1), "AdamW beta2", "actor.betas[1]"),
    "adam_epsilon": _no("AdamW epsilon", "AdamW's epsilon here is torch's 1e-8", (1e-8,)),
    "optim_target_modules": _no("modules for GaLore-style optimizers", "not supported"),
    "gradient_accumulation_steps": _conv(_with_batch("gradient_accumulation_steps"), "micro steps per optimizer "
                                         "step", "part of per_device_train_batch_size's translation (the "
                                         "accumulation itself is the micro batching here)"),
    "average_tokens_across_devices": _no("token counts summed over devices", "token counts are summed over "
                                         "ranks here (LossNorm)", (True,)),
    "max_grad_norm": _to("actor.grad_clip", "gradient-norm clip"),
    "label_smoothing_factor": _no("label smoothing", "not used by GRPO"),
    "bf16": _no("bf16 mixed precision", "precision is each backend's (roles.<name>.options, docs/backends.md)"),
    "fp16": _no("fp16 mixed precision", "precision is each backend's (roles.<name>.options, docs/backends.md)"),
    "bf16_full_eval": _no("bf16 evaluation", "precision is each backend's"),
    "fp16_full_eval": _no("fp16 evaluation", "precision is each backend's"),
    "tf32": _no("TF32 matmuls", "precision is each backend's", (None, False)),
    "gradient_checkpointing": _noop("activation recomputation", _MEMORY),
    "gradient_checkpointing_kwargs": _noop("activation recomputation options", _MEMORY),
    "torch_compile": _noop("torch.compile the model", _MEMORY),
    "torch_compile_backend": _noop("torch.compile backend", _MEMORY),
    "torch_compile_mode": _noop("torch.compile mode", _MEMORY),
    "use_liger_kernel": _no("Liger kernels", "not supported"),
    "liger_kernel_config": _no("Liger kernel options", "not supported"),
    "use_cache": _noop("the KV cache in training forwards", _MEMORY),
    "neftune_noise_alpha": _no("NEFTune embedding noise", "not supported"),
    "torch_empty_cache_steps": _noop("empty the CUDA cache every N steps", _MEMORY),
    "auto_find_batch_size": _no("shrink the batch on OOM", "not supported: the planner sizes micro batches"),
    "logging_strategy": _noop("when to log", _LOGGING),
    "logging_steps": _to("logging.console_every", "log every N steps", _LOGGING),
    "logging_first_step": _noop("log the first step", _LOGGING),
    "log_on_each_node": _noop("log on every node", _LOGGING),
    "logging_nan_inf_filter": _noop("drop nan/inf losses from the logged mean", _LOGGING),
    "include_num_input_tokens_seen": _noop("count input tokens", "tokens/* metrics are logged every step here"),
    "log_level": _noop("log level", _LOGGING),
    "log_level_replica": _noop("log level of replicas", _LOGGING),
    "disable_tqdm": _conv(_disable_tqdm, "hide the progress bar", "logging.progress = not disable_tqdm"),
    "report_to": _conv(_report_to, "the trackers", "logging.trackers ('none': [])"),
    "run_name": _noop("the tracker's run name", "the run is named after output_dir here"),
    "project": _noop("the tracker's project", "W&B reads WANDB_PROJECT here"),
    "trackio_space_id": _no("Trackio space", "no Trackio tracker here"),
    "trackio_bucket_id": _no("Trackio bucket", "no Trackio tracker here"),
    "trackio_static_space_id": _no("Trackio static space", "no Trackio tracker here"),
    "eval_strategy": _conv(_eval_strategy, "when to evaluate", "'steps' with eval_steps is validation.every"),
    "eval_steps": _conv(_every("eval_strategy", "validation.every"), "evaluate every N steps", "validation.every "
                        "(with eval_strategy 'steps')"),
    "eval_delay": _no("steps before the first evaluation", "not supported"),
    "per_device_eval_batch_size": _noop("evaluation batch per device", _MEMORY),
    "prediction_loss_only": _noop("evaluate the loss only", "validation here generates and scores"),
    "eval_on_start": _conv(_eval_first, "evaluate before training", "validation.before_train"),
    "eval_do_concat_batches": _noop("concatenate evaluation batches", _MEMORY),
    "eval_use_gather_object": _noop("gather evaluation objects", _MEMORY),
    "eval_accumulation_steps": _noop("evaluation accumulation", _MEMORY),
    "include_for_metrics": _no("inputs for compute_metrics", "not supported"),
    "batch_eval_metrics": _no("batched compute_metrics", "not supported"),
    "save_only_model": _no("checkpoints without optimizer state", "checkpoints hold the optimizer here (--resume)"),
    "save_strategy": _conv(_strategy("save_steps", "checkpoint.every"), "when to checkpoint", "'no': "
                           "checkpoint.every 0; 'steps' with save_steps"),
    "save_steps": _conv(_every("save_strategy", "checkpoint.every"), "checkpoint every N steps", "checkpoint.every"),
    "save_on_each_node": _noop("save on every node", "checkpoints are written once per run here"),
    "save_total_limit": _conv(lambda v, c: {} if v is None else {"checkpoint.keep": v}, "checkpoints kept",
                              "checkpoint.keep"),
    "enable_jit_checkpoint": _conv(lambda v, c: {} if v else {"checkpoint.sigterm_grace_s": 0},
                                   "checkpoint on a preemption "
                                   "signal", "true: what SIGTERM does here anyway (checkpoint.sigterm_grace_s); false: "
                                   "checkpoint.sigterm_grace_s 0, SIGTERM stops at once"),
    "push_to_hub": _no("upload to the Hub", "no Hub uploads: hybridflow export, then huggingface-cli upload"),
    "hub_token": _noop("Hub token", _HUB),
    "hub_private_repo": _noop("Hub repo privacy", _HUB),
    "hub_model_id": _noop("Hub repo", _HUB),
    "hub_strategy": _noop("when to push", _HUB),
    "hub_always_push": _noop("push even while one is running", _HUB),
    "hub_revision": _noop("Hub revision", _HUB),
    "load_best_model_at_end": _no("reload the best checkpoint", "not supported: the final policy is the last step's"),
    "metric_for_best_model": _noop("the metric of the best checkpoint", "read only with load_best_model_at_end"),
    "greater_is_better": _noop("the best checkpoint's direction", "read only with load_best_model_at_end"),
    "ignore_data_skip": _no("restart the data order on resume", "a resumed run continues its data order here"),
    "restore_callback_states_from_checkpoint": _no("restore callbacks", "there are no trainer callbacks here"),
    "full_determinism": _no("deterministic kernels", "not supported (seeded runs repeat on one machine)"),
    "data_seed": _no("the data order's own seed", "seed seeds the data order here"),
    "use_cpu": _noop("train on CPU", "the device is whatever the machine has"),
    "accelerator_config": _no("Accelerate options", "not supported"),
    "parallelism_config": _no("Accelerate parallelism",
                              "placement is a plan here (placement.mode: auto, docs/planner.md)"),
    "dataloader_drop_last": _no("drop the last partial batch", "batches are always full here (prompts cycle)"),
    "dataloader_num_workers": _noop("data-loader processes", _MEMORY),
    "dataloader_pin_memory": _noop("pinned loader memory", _MEMORY),
    "dataloader_persistent_workers": _noop("keep loader workers", _MEMORY),
    "dataloader_prefetch_factor": _noop("loader prefetch", _MEMORY),
    "dataloader_multiprocessing_context": _noop("loader start method", _MEMORY),
    "dataloader_in_order": _noop("loader order across workers", _MEMORY),
    "remove_unused_columns": _noop("drop dataset columns", "every column reaches the reward functions here"),
    "label_names": _noop("label columns", "not used by GRPO"),
    "train_sampling_strategy": _no("how prompts are sampled", "prompts are drawn in a seeded shuffle per epoch "
                                   "here", ("random",)),
    "length_column_name": _noop("length column", "not used by GRPO"),
    "ddp_find_unused_parameters": _noop("DDP option", _MEMORY),
    "ddp_bucket_cap_mb": _noop("DDP bucket size", _MEMORY),
    "ddp_broadcast_buffers": _noop("DDP option", _MEMORY),
    "ddp_static_graph": _noop("DDP option", _MEMORY),
    "ddp_backend": _noop("the process-group backend", "chosen per device here (nccl, gloo)"),
    "ddp_timeout": _noop("process-group timeout", "executor.liveness.* sets the deadlines here"),
    "fsdp": _no("FSDP", "roles.actor.backend: fsdp (docs/backends.md)"),
    "fsdp_config": _no("FSDP options", "roles.actor.options with backend fsdp (docs/backends.md)"),
    "deepspeed": _no("a DeepSpeed config", "roles.actor.backend: deepspeed with roles.actor.options"),
    "debug": _no("debug modes", "not supported"),
    "skip_memory_metrics": _noop("memory metrics", "memory/* metrics are logged here"),
    "do_train": _noop("a script flag", "unused by the trainer"),
    "do_eval": _noop("a script flag", "unused by the trainer"),
    "do_predict": _noop("a script flag", "unused by the trainer"),
    "resume_from_checkpoint": _no("resume a run", "hybridflow train --resume"),
    "local_rank": _noop("set by the launcher", "set by the launcher"),
    "model_init_kwargs": _no("from_pretrained options", "not supported: model.path is a local directory"),
    "trust_remote_code": _no("run a model's own code", "not supported"),
    "router_aux_loss_coef": _no("MoE load-balancing loss", "not supported"),
    "disable_dropout": _no("turn dropout off", "not supported: models train with their own dropout"),
    "cast_lm_head_to_fp32": _no("fp32 output head", "not supported"),
    "num_generations": _to("algorithm_options.n", "completions per prompt"),
    "num_generations_eval": _no("completions per prompt at evaluation", "not supported"),
    "max_completion_length": _to("algorithm_options.max_new_tokens", "most tokens per completion"),
    "ds3_gather_for_generation": _noop("gather ZeRO-3 weights to generate", _MEMORY),
    "shuffle_dataset": _no("shuffle the prompts", "prompts are shuffled (seeded) here", (True,)),
    "pad_to_multiple_of": _noop("pad lengths to a multiple", _MEMORY),
    "generation_batch_size": _conv(_with_batch("generation_batch_size"), "completions per generation",
                                   "part of per_device_train_batch_size's translation"),
    "steps_per_generation": _conv(_with_batch("steps_per_generation"), "optimizer steps per generation",
                                  "part of per_device_train_batch_size's translation (actor.mini_batches)"),
    "temperature": _to("algorithm_options.temperature", "sampling temperature"),
    "top_p": _to("algorithm_options.top_p", "nucleus sampling"),
    "top_k": _to("algorithm_options.top_k", "top-k sampling"),
    "min_p": _no("min-p sampling", "not supported"),
    "generation_kwargs": _no("extra sampling options", "not supported"),
    "chat_template_kwargs": _no("chat template options", "not supported"),
    "repetition_penalty": _no("repetition penalty", "not supported", (1.0,)),
    "cache_implementation": _noop("the generation cache", _MEMORY),
    "use_vllm": _conv(_use_vllm, "generate with vLLM", "roles.actor.rollout: vllm"),
    "vllm_mode": _no("vLLM colocated or a server", "vLLM runs as a rollout engine here", ("colocate",)),
    "vllm_model_impl": _noop("vLLM's model code", "vLLM's own choice"),
    "vllm_enable_sleep_mode": _noop("vLLM sleeps while training", "roles.<policy>.rollout_options.sleep_level"),
    "vllm_structured_outputs_regex": _no("constrained decoding", "not supported"),
    "vllm_server_base_url": _noop("vLLM server", "read only with vllm_mode 'server' (refused)"),
    "vllm_server_host": _noop("vLLM server", "read only with vllm_mode 'server' (refused)"),
    "vllm_server_port": _noop("vLLM server", "read only with vllm_mode 'server' (refused)"),
    "vllm_server_timeout": _noop("vLLM server", "read only with vllm_mode 'server' (refused)"),
    "vllm_group_port": _noop("vLLM server", "read only with vllm_mode 'server' (refused)"),
    "vllm_gpu_memory_utilization": _conv(_vllm_option("gpu_memory_utilization"), "vLLM's memory share",
                                         "roles.actor.rollout_options.gpu_memory_utilization (with use_vllm)"),
    "vllm_max_model_length": _conv(_vllm_option("max_model_len"), "vLLM's context", "roles.actor.rollout_options."
                                   "max_model_len (with use_vllm)"),
    "vllm_tensor_parallel_size": _conv(_vllm_option("tensor_parallel_size"), "vLLM tensor parallelism",
                                       "roles.actor.rollout_options.tensor_parallel_size (with use_vllm)"),
    "beta": _conv(_beta, "KL coefficient (k3, in the loss)", "algorithm_options.kl_coef (a loss term in grpo, "
                  "dr_grpo, gspo)"),
    "num_iterations": _to("actor.epochs", "updates per batch (mu)"),
    "epsilon": _to("algorithm_options.clip_ratio", "lower clip range"),
    "delta": _no("two-sided clipping bound (INTELLECT-2)", "not built in"),
    "epsilon_high": _to("algorithm_options.clip_ratio_high", "upper clip range"),
    "sapo_temperature_neg": _noop("SAPO option", "read only with loss_type 'sapo' (refused)"),
    "sapo_temperature_pos": _noop("SAPO option", "read only with loss_type 'sapo' (refused)"),
    "vespo_k_pos": _noop("VESPO option", "read only with loss_type 'vespo' (refused)"),
    "vespo_lambda_pos": _noop("VESPO option", "read only with loss_type 'vespo' (refused)"),
    "vespo_k_neg": _noop("VESPO option", "read only with loss_type 'vespo' (refused)"),
    "vespo_lambda_neg": _noop("VESPO option", "read only with loss_type 'vespo' (refused)"),
    "importance_sampling_level": _conv(_sequence_level, "token or sequence ratios", "'sequence' is algorithm "
                                       "gspo", first=True),
    "reward_weights": _to("data.reward_weights", "weights of the reward functions"),
    "multi_objective_aggregation": _no("how rewards combine", "the weighted sum is normalised here",
                                       ("sum_then_normalize",)),
    "scale_rewards": _conv(_scale_rewards, "advantage std scaling", "algorithm_options.scale_rewards"),
    "loss_type": _conv(_loss_type, "loss aggregation", "grpo: loss_agg seq-mean-token-mean; dapo: token-mean; "
                       "dr_grpo: algorithm dr_grpo; bnpo and others refused", first=True),
    "mask_truncated_completions": _to("algorithm_options.mask_truncated", "no loss on truncated completions"),
    "sync_ref_model": _no("TR-DPO reference updates", "not built in: the reference stays the starting policy"),
    "ref_model_mixup_alpha": _noop("TR-DPO option", "read only with sync_ref_model (refused)"),
    "ref_model_sync_steps": _noop("TR-DPO option", "read only with sync_ref_model (refused)"),
    "top_entropy_quantile": _no("train on the high-entropy tokens only", "not built in", (1.0,)),
    "entropy_coef": _to("algorithm_options.entropy_coef", "entropy bonus"),
    "use_adaptive_entropy": _no("adaptive entropy coefficient", "not built in"),
    "entropy_coef_min": _noop("adaptive entropy option", "read only with use_adaptive_entropy (refused)"),
    "entropy_coef_max": _noop("adaptive entropy option", "read only with use_adaptive_entropy (refused)"),
    "entropy_coef_delta": _noop("adaptive entropy option", "read only with use_adaptive_entropy (refused)"),
    "entropy_target": _noop("adaptive entropy option", "read only with use_adaptive_entropy (refused)"),
    "max_tool_calling_iterations": _no("tool-calling turns", "agent.environment and agent.max_turns "
                                       "(docs/agents.md)"),
    "vllm_importance_sampling_correction": _conv(_vllm_correction, "correct vLLM's sampling mismatch",
                                                 "algorithm_options.rollout_correction (token modes)"),
    "vllm_importance_sampling_mode": _noop("the correction's mode", "read with "
                                           "vllm_importance_sampling_correction"),
    "vllm_importance_sampling_clip_max": _noop("the correction's cap", "read with "
                                               "vllm_importance_sampling_correction (rollout_is_cap)"),
    "vllm_importance_sampling_clip_min": _no("the correction's lower bound", "not built in"),
    "vllm_importance_sampling_cap": _noop("the correction's cap (deprecated)", "read with "
                                          "vllm_importance_sampling_correction (rollout_is_cap)"),
    "off_policy_mask_threshold": _no("off-policy sequence masking", "not built in"),
    "use_bias_correction_kl": _conv(_bias_corrected_kl, "KL times the importance ratio", "accepted with beta 0 "
                                    "or false; else refused"),
    "log_completions": _noop("print completions", "validation_samples.jsonl holds completions here"),
    "log_multimodal": _noop("log images", "no multimodal data here"),
    "num_completions_to_print": _noop("completions printed", "validation.samples sets how many are kept"),
    "log_unique_prompts": _noop("log unique prompts", _LOGGING),
    "log_completions_hub_repo": _no("upload completions", "no Hub uploads"),
    "use_transformers_continuous_batching": _no("transformers' continuous batching", "roles.actor.rollout picks "
                                                "the engine (native, hf_generate, vllm)"),
    "transformers_continuous_batching_config": _no("its options", "roles.actor.rollout_options"),
    "use_transformers_paged": _no("paged generation (deprecated)", "roles.actor.rollout picks the engine"),
}
