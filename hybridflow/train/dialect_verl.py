"""verl 0.9's trainer keys (``verl/trainer/config/ppo_trainer.yaml`` with its Hydra defaults) as config keys:
each is renamed to ours, accepted as a no-op or refused saying why (:mod:`hybridflow.train.aliases`).

Keys are verl's full dotted paths; a dotted suffix of one works too (``rollout.n``, ``actor.optim.lr``) when it
names one verl key. Whole subtrees share an entry through a ``**`` pattern (``global_profiler.**``).
tests/train/test_dialects.py checks every key of verl 0.9.1's generated trainer config is classified here.
"""

from __future__ import annotations

import functools
from typing import Any

from hybridflow.train.aliases import ANY, OFF, Context, ForeignKey, Refused

SOURCE = "verl"
ACTOR = "actor_rollout_ref.actor."
ROLLOUT = "actor_rollout_ref.rollout."
MODEL = "actor_rollout_ref.model."
KL_LOSS = ("grpo", "dr_grpo", "gspo")  # kl_coef is a loss term (verl's use_kl_loss)
KL_REWARD = ("ppo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline")  # kl_coef is a reward penalty
ESTIMATORS = {"gae": "ppo", "grpo": "grpo", "rloo": "rloo", "remax": "remax", "reinforce_plus_plus": "reinforce_pp",
              "reinforce_plus_plus_baseline": "reinforce_pp_baseline"}


def _to(target: str, meaning: str, why: str = "") -> ForeignKey:
    return ForeignKey(source=SOURCE, meaning=meaning, target=target, why=why)


def _conv(convert: Any, meaning: str, why: str = "", first: bool = False) -> ForeignKey:
    return ForeignKey(source=SOURCE, meaning=meaning, convert=convert, why=why, first=first)


def _noop(meaning: str, why: str, harmless: Any = ANY) -> ForeignKey:
    return ForeignKey(source=SOURCE, meaning=meaning, harmless=harmless, why=why)


def _no(meaning: str, why: str, harmless: Any = OFF) -> ForeignKey:
    return ForeignKey(source=SOURCE, meaning=meaning, harmless=harmless, why=why)


def _unless_null(target: str) -> Any:
    return lambda value, context: {} if value is None else {target: value}


def _estimator(value: Any, context: Context) -> dict[str, Any]:
    if value not in ESTIMATORS:
        raise Refused(f"the built-in algorithms are {sorted(ESTIMATORS)} (verl's names) or ours: algorithm: ...")
    return {"algorithm": ESTIMATORS[value]}


def _kl_in_reward(value: Any, context: Context) -> dict[str, Any]:
    algorithm = context["algorithm"]
    if bool(value) == (algorithm in KL_REWARD):
        return {}
    where = "in the reward" if algorithm in KL_REWARD else "in the loss" if algorithm in KL_LOSS else "nowhere"
    raise Refused(f"algorithm {algorithm!r} puts KL {where}: that is fixed by the algorithm here")


def _kl_reward_coef(value: Any, context: Context) -> dict[str, Any]:
    if context["algorithm"] in KL_REWARD:
        return {"algorithm_options.kl_coef": value}
    return {}  # read by verl only with use_kl_in_reward, which is the algorithm's here


def _use_kl_loss(value: Any, context: Context) -> dict[str, Any]:
    algorithm = context["algorithm"]
    if algorithm in KL_LOSS:
        return {} if value else {"algorithm_options.kl_coef": 0.0}
    if value:
        raise Refused(f"algorithm {algorithm!r} has no KL loss term (grpo, dr_grpo, gspo have)")
    return {}


def _kl_loss_coef(value: Any, context: Context) -> dict[str, Any]:
    if context["algorithm"] not in KL_LOSS or context.get(ACTOR + "use_kl_loss") is False:
        return {}  # verl reads it only with use_kl_loss, which these algorithms imply
    return {"algorithm_options.kl_coef": value}


def _kl_type(value: Any, context: Context) -> dict[str, Any]:
    if value in ("low_var_kl", "k3"):
        return {}
    raise Refused("the built-in KL loss term is k3 (low_var_kl); another estimator needs your own graph "
                  "(ppo_policy's kl_type, docs/algorithms.md)")


def _strategy(role: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if value in ("fsdp", "fsdp2"):
            return {f"roles.{role}.backend": "fsdp"}
        raise Refused("the training backends are torch, fsdp and deepspeed (roles.<name>.backend)")
    return convert


def _rollout_name(value: Any, context: Context) -> dict[str, Any]:
    engines = {"vllm": "vllm", "hf": "hf_generate"}
    if value not in engines:
        raise Refused("the rollout engines are native, hf_generate, vllm (roles.actor.rollout)")
    return {"roles.actor.rollout": engines[value]}


def _vllm_option(name: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if context.get(ROLLOUT + "name") != "vllm" or value is None:
            return {}  # an engine setting: only vLLM's is ours
        return {f"roles.actor.rollout_options.{name}": value}
    return convert


def _top_k(value: Any, context: Context) -> dict[str, Any]:
    return {"algorithm_options.top_k": 0 if value == -1 else value}  # verl's -1 is our 0: off


def _loss_mode(value: Any, context: Context) -> dict[str, Any]:
    if value == "vanilla":
        return {}
    if value == "gspo":
        return {"algorithm": "gspo"}
    raise Refused("the built-in policy losses are vanilla (PPO clip) and gspo (algorithm gspo)")


def _epochs(value: Any, context: Context) -> dict[str, Any]:
    if context.get("trainer.total_training_steps") is not None:
        return {}  # verl ignores the epochs when the step count is given
    raise Refused("here runs count steps: write trainer.total_training_steps (= total_epochs x rows / "
                  "train_batch_size)")


def _warmup_steps(value: Any, context: Context) -> dict[str, Any]:
    return {} if value in (-1, None) else {"actor.warmup_steps": value}  # -1: use the ratio


def _scheduler(target: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if value is None:
            return {}
        if value not in ("constant", "cosine"):
            raise Refused("verl's schedules are constant and cosine; here actor.lr_scheduler")
        return {target: value}
    return convert


def _gpus(value: Any, context: Context) -> dict[str, Any]:
    nodes = context.get("trainer.nnodes", 1)
    return {"num_gpus": value * nodes if isinstance(nodes, int) else value}


def _nodes(value: Any, context: Context) -> dict[str, Any]:
    if value == 1 or "trainer.n_gpus_per_node" in context:
        return {}  # folded into num_gpus
    raise Refused("give trainer.n_gpus_per_node too: num_gpus = nnodes x n_gpus_per_node (executor: ray)")


def _logger(value: Any, context: Context) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    trackers = [n for n in names if n != "console"]  # the console shows a progress bar (console_metrics_every)
    unknown = sorted(set(trackers) - {"tensorboard", "wandb", "mlflow"})
    if unknown:
        raise Refused(f"{unknown} have no tracker here; the trackers are tensorboard, wandb, mlflow")
    return {"trackers": trackers}


def _val_before_train(value: Any, context: Context) -> dict[str, Any]:
    if value and not (context.get("data.val_files") or context.get("data.val_path")):
        return {}  # verl validates only with a validation set (its default is true): nothing to validate
    return {"validate_before_train": bool(value)}


def _reward(section: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if value is None:
            return {}
        return {"data.reward": f"{value}:{context.get(section + 'name') or 'compute_score'}"}
    return convert


def _only(option: str, algorithms: tuple[str, ...]) -> Any:
    """An option of some algorithms; verl reads it only for those too, so elsewhere it changes nothing."""
    def convert(value: Any, context: Context) -> dict[str, Any]:
        return {f"algorithm_options.{option}": value} if context["algorithm"] in algorithms else {}
    return convert


def _kl_control(value: Any, context: Context) -> dict[str, Any]:
    if value == "fixed":
        return {}
    if value == "adaptive" and context["algorithm"] == "ppo":
        return {"algorithm_options.kl_target": context.get("algorithm.kl_ctrl.target_kl", 0.1),
                "algorithm_options.kl_horizon": context.get("algorithm.kl_ctrl.horizon", 10000)}
    raise Refused("fixed, or adaptive with algorithm ppo (algorithm_options.kl_target)")


def _positive_or_off(target: str) -> Any:
    return lambda value, context: {target: 0 if value is None or value < 0 else value}  # verl's -1: never


_MEMORY = "memory or speed only: the numbers trained are the same"
_PROFILE = "no profiler hooks here; per-node times are in the step metrics (time/*)"
_FSDP = "verl's engine setting; here roles.<name>.backend (torch, fsdp, deepspeed) with roles.<name>.options"
_MTP = "multi-token prediction is not supported"
_LORA = "LoRA is roles.actor.lora (rank, alpha, dropout, target_modules)"


def _engine_keys(prefix: str) -> dict[str, ForeignKey]:
    """Settings verl's actor, reference and critic share: engine, micro batches, kernels, checkpoints."""
    return {
        prefix + "fsdp_config.param_offload": _noop("parameter offload", _MEMORY),
        prefix + "fsdp_config.optimizer_offload": _noop("optimizer offload", _MEMORY),
        prefix + "fsdp_config.**": _no("FSDP engine settings", _FSDP),
        prefix + "ulysses_sequence_parallel_size": _no("sequence parallelism", "not supported", (1,)),
        prefix + "entropy_from_logits_with_chunking": _noop("chunked entropy", _MEMORY),
        prefix + "entropy_from_logits_chunk_size": _noop("chunked entropy", _MEMORY),
        prefix + "entropy_checkpointing": _noop("entropy recomputation", _MEMORY),
        prefix + "use_torch_compile": _noop("torch.compile", _MEMORY),
        prefix + "pad_to_length": _noop("pad to fixed lengths", _MEMORY),
        prefix + "rollout_n": _noop("a copy of rollout.n", "verl fills it in"),
        prefix + "profiler.**": _no("profiler", _PROFILE),
    }


def _model_keys(prefix: str, role: str) -> dict[str, ForeignKey]:
    keys = {
        prefix + "hf_config_path": _no("a separate config.json", "the model directory's own"),
        prefix + "tokenizer_path": _no("a separate tokenizer", "the model directory's own"),
        prefix + "use_shm": _noop("load through /dev/shm", _MEMORY),
        prefix + "trust_remote_code": _no("run a model's own code", "not supported"),
        prefix + "custom_chat_template": _no("a chat template", "the tokenizer's own"),
        prefix + "external_lib": _no("import a library for the model", "not supported"),
        prefix + "override_config": _no("config.json overrides", "not supported"),
        prefix + "enable_gradient_checkpointing": _noop("activation recomputation", _MEMORY),
        prefix + "enable_activation_offload": _noop("activation offload", _MEMORY),
        prefix + "use_remove_padding": _noop("padding-free forwards", "sequences are packed here (padding: false)"),
        prefix + "lora_rank": _no("LoRA rank", _LORA),
        prefix + "lora_alpha": _noop("LoRA alpha", "read only with lora_rank > 0 (refused)"),
        prefix + "target_modules": _noop("LoRA modules", "read only with lora_rank > 0 (refused)"),
        prefix + "exclude_modules": _no("LoRA modules left out", _LORA),
        prefix + "lora_adapter_path": _no("a LoRA adapter to start from", "not supported"),
        prefix + "use_liger": _no("Liger kernels", "not supported"),
        prefix + "use_fused_kernels": _no("fused kernels", "not supported"),
        prefix + "fused_kernel_options.**": _noop("fused kernel options", "read only with use_fused_kernels"),
        prefix + "tiled_mlp.enabled": _no("tiled MLP", "not supported"),
        prefix + "tiled_mlp.num_shards": _noop("tiled MLP shards", "read only with tiled_mlp.enabled"),
        prefix + "mtp.enable": _no("multi-token prediction", _MTP),
        prefix + "mtp.**": _noop("multi-token prediction options", "read only with mtp.enable (refused)"),
        prefix + "lora.rank": _no("Megatron LoRA rank", _LORA),
        prefix + "lora.**": _noop("Megatron LoRA options", "read only with lora.rank > 0 (refused)"),
    }
    if role == "actor":
        keys[prefix + "path"] = _to("model.path", "the policy's HF directory")
    else:
        keys[prefix + "path"] = _to(f"roles.{role}.model", "the critic's HF directory")
    return keys


def _optim_keys(prefix: str, ours: str) -> dict[str, ForeignKey]:
    return {
        prefix + "lr": _to(f"{ours}.lr", "learning rate"),
        prefix + "lr_warmup_steps_ratio": _to(f"{ours}.warmup_ratio", "warmup as a ratio of the steps"),
        prefix + "lr_warmup_steps": _conv(_warmup_steps, "warmup steps (-1: use the ratio)", f"{ours}.warmup_steps"),
        prefix + "total_training_steps": _noop("the schedule's length", "verl fills it in; here the run's steps"),
        prefix + "weight_decay": _to(f"{ours}.weight_decay", "AdamW weight decay"),
        prefix + "betas": _to(f"{ours}.betas", "AdamW betas"),
        prefix + "clip_grad": _to(f"{ours}.grad_clip", "gradient-norm clip"),
        prefix + "min_lr_ratio": _to(f"{ours}.min_lr_ratio", "the cosine schedule's floor"),
        prefix + "num_cycles": _no("cosine cycles", "the cosine schedule here is one half cycle", (0.5,)),
        prefix + "lr_scheduler_type": _conv(_scheduler(f"{ours}.lr_scheduler"), "the schedule",
                                            f"{ours}.lr_scheduler"),
        prefix + "warmup_style": _conv(_scheduler(f"{ours}.lr_scheduler"), "the schedule (deprecated name)",
                                       f"{ours}.lr_scheduler"),
        prefix + "optimizer": _no("the optimizer", "the optimizer here is torch AdamW", ("AdamW",)),
        prefix + "optimizer_impl": _no("the optimizer's module", "the optimizer here is torch AdamW",
                                       ("torch.optim",)),
        prefix + "zero_indexed_step": _no("the schedule's first step", "the schedule counts from 0 here", (True,)),
        prefix + "override_optimizer_config": _no("optimizer overrides", "not supported"),
    }


def _actor_keys() -> dict[str, ForeignKey]:
    a = ACTOR
    return {
        **_optim_keys(a + "optim.", "actor"),
        **_engine_keys(a),
        a + "strategy": _conv(_strategy("actor"), "the training engine", "roles.actor.backend"),
        a + "ppo_mini_batch_size": _no("prompts per mini-batch", "here actor.mini_batches is how many "
                                       "mini-batches a step's batch is cut into: actor.mini_batches = "
                                       "data.batch_size / ppo_mini_batch_size", ()),
        a + "ppo_micro_batch_size": _no("rows per micro batch over all GPUs (deprecated)",
                                        "write ppo_micro_batch_size_per_gpu (actor.micro_batch_size)"),
        a + "ppo_micro_batch_size_per_gpu": _conv(_unless_null("actor.micro_batch_size"), "rows per forward/"
                                                  "backward pass per GPU", "actor.micro_batch_size"),
        a + "use_dynamic_bsz": _no("token-budget micro batches", "write roles.actor.max_tokens_per_micro_batch "
                                   "(= ppo_max_token_len_per_gpu)"),
        a + "ppo_max_token_len_per_gpu": _noop("the token budget", "read only with use_dynamic_bsz (refused)"),
        a + "clip_ratio": _to("algorithm_options.clip_ratio", "PPO clip range"),
        a + "clip_ratio_low": _to("algorithm_options.clip_ratio", "lower clip range"),
        a + "clip_ratio_high": _to("algorithm_options.clip_ratio_high", "upper clip range"),
        a + "clip_ratio_c": _no("dual-clip bound (always on in verl)", "the built-in algorithms do not dual-clip; "
                                "ppo_policy's dual_clip in your own graph (docs/algorithms.md)", ()),
        a + "tau_pos": _noop("SAPO option", "read only with policy_loss.loss_mode sapo (refused)"),
        a + "tau_neg": _noop("SAPO option", "read only with policy_loss.loss_mode sapo (refused)"),
        a + "freeze_vision_tower": _no("freeze a vision tower", "no vision models here"),
        a + "policy_loss.loss_mode": _conv(_loss_mode, "the policy loss", "vanilla accepted; gspo: algorithm gspo",
                                           first=True),
        a + "policy_loss.**": _noop("options of other policy losses", "read only by loss modes that are refused"),
        a + "loss_agg_mode": _to("algorithm_options.loss_agg", "loss aggregation (same mode names)"),
        a + "loss_scale_factor": _conv(_unless_null("algorithm_options.loss_scale_factor"), "seq-mean-token-sum-norm"
                                       "'s constant", "algorithm_options.loss_scale_factor"),
        a + "entropy_coeff": _to("algorithm_options.entropy_coef", "entropy bonus"),
        a + "calculate_entropy": _noop("compute the entropy", "actor/entropy is always logged here"),
        a + "calculate_sum_pi_squared": _no("sum of squared probabilities", "not computed here"),
        a + "use_kl_loss": _conv(_use_kl_loss, "KL to the reference in the loss", "implied by the algorithm "
                                 "(grpo, dr_grpo, gspo); false: algorithm_options.kl_coef 0"),
        a + "use_prefix_grouper": _no("shared-prefix forwards", "not supported"),
        a + "kl_loss_coef": _conv(_kl_loss_coef, "the KL loss coefficient", "algorithm_options.kl_coef (in grpo, "
                                  "dr_grpo, gspo; dropped with use_kl_loss: false)"),
        a + "kl_loss_type": _conv(_kl_type, "the KL estimator", "accepted at low_var_kl (k3, ours); else refused"),
        a + "ppo_epochs": _to("actor.epochs", "updates per batch"),
        a + "shuffle": _no("shuffle mini-batches", "mini-batches keep the batch's order here"),
        a + "data_loader_seed": _noop("the mini-batch shuffle's seed", "read only with shuffle (refused)"),
        a + "checkpoint.save_contents": _noop("what a checkpoint holds", "model, optimizer and state, always"),
        a + "checkpoint.load_contents": _noop("what a resume loads", "all of it (--resume)"),
        a + "checkpoint.async_save": _no("asynchronous checkpoints", "not supported"),
        a + "checkpoint.strict": _noop("strict checkpoint loading", "always strict here"),
        a + "use_fused_kernels": _no("fused kernels", "not supported"),
        a + "qat.enable": _no("quantisation-aware training", "not supported"),
        a + "qat.**": _noop("QAT options", "read only with qat.enable (refused)"),
        a + "grad_clip": _to("actor.grad_clip", "gradient-norm clip"),
        a + "use_remove_padding": _noop("padding-free forwards", "sequences are packed here (padding: false)"),
        a + "router_replay.mode": _no("MoE router replay", "not supported", ("disabled",)),
        a + "router_replay.**": _noop("router replay options", "read only with router_replay.mode (refused)"),
    }


def _ref_keys() -> dict[str, ForeignKey]:
    r = "actor_rollout_ref.ref."
    return {
        **_engine_keys(r),
        r + "strategy": _noop("the reference's engine", "the reference runs on the policy's backend"),
        r + "log_prob_micro_batch_size": _no("rows per reference forward over all GPUs (deprecated)",
                                             "write log_prob_micro_batch_size_per_gpu"),
        r + "log_prob_micro_batch_size_per_gpu": _conv(_unless_null("roles.reference.micro_batch_size"), "rows per "
                                                       "reference forward per GPU", "roles.reference.micro_batch_size"),
        r + "log_prob_use_dynamic_bsz": _no("token-budget micro batches", "roles.reference.max_tokens_per_micro_batch"),
        r + "log_prob_max_token_len_per_gpu": _noop("the token budget", "read only with log_prob_use_dynamic_bsz"),
    }


def _rollout_keys() -> dict[str, ForeignKey]:
    r = ROLLOUT
    return {
        r + "name": _conv(_rollout_name, "the rollout engine", "roles.actor.rollout (vllm; hf: hf_generate)"),
        r + "mode": _noop("sync or async engine calls", "the engine's own"),
        r + "nnodes": _noop("rollout nodes", "placement is a plan here (docs/planner.md)"),
        r + "n_gpus_per_node": _noop("rollout GPUs per node", "placement is a plan here (docs/planner.md)"),
        r + "temperature": _to("algorithm_options.temperature", "sampling temperature"),
        r + "top_k": _conv(_top_k, "top-k sampling (-1: off)", "algorithm_options.top_k (0: off)"),
        r + "top_p": _to("algorithm_options.top_p", "nucleus sampling"),
        r + "full_determinism": _no("deterministic sampling", "not supported"),
        r + "seed": _noop("the engine's seed", "seed seeds the engine here"),
        r + "prompt_length": _noop("the engine's prompt budget", "data.max_prompt_length"),
        r + "response_length": _noop("the engine's response budget", "data.max_response_length"),
        r + "dtype": _noop("the engine's dtype", "roles.actor.rollout_options.dtype"),
        r + "gpu_memory_utilization": _conv(_vllm_option("gpu_memory_utilization"), "vLLM's memory share",
                                            "roles.actor.rollout_options.gpu_memory_utilization (vllm)"),
        r + "ignore_eos": _no("sample past the end token", "not supported"),
        r + "enforce_eager": _noop("no CUDA graphs", _MEMORY),
        r + "cudagraph_capture_sizes": _noop("CUDA graph sizes", _MEMORY),
        r + "free_cache_engine": _noop("free the KV cache between rollouts", _MEMORY),
        r + "tensor_model_parallel_size": _conv(_vllm_option("tensor_parallel_size"), "rollout tensor parallelism",
                                                "roles.actor.rollout_options.tensor_parallel_size (vllm)"),
        r + "data_parallel_size": _noop("rollout replicas", "placement is a plan here"),
        r + "expert_parallel_size": _no("rollout expert parallelism", "not supported", (1,)),
        r + "pipeline_model_parallel_size": _no("rollout pipeline parallelism", "not supported", (1,)),
        r + "max_num_batched_tokens": _noop("engine batching", _MEMORY),
        r + "max_model_len": _conv(_vllm_option("max_model_len"), "the engine's context",
                                   "roles.actor.rollout_options.max_model_len (vllm)"),
        r + "max_num_seqs": _noop("engine batching", _MEMORY),
        r + "enable_chunked_prefill": _noop("chunked prefill", _MEMORY),
        r + "enable_prefix_caching": _noop("prefix caching", _MEMORY),
        r + "logprobs_mode": _noop("what the engine's log-probs are", "rollout log-probs are of the raw logits "
                                   "here (docs/algorithms.md)"),
        r + "scheduling_policy": _noop("engine scheduling", _MEMORY),
        r + "load_format": _noop("how the engine loads weights", "weights are synced from the trainer"),
        r + "layered_summon": _noop("gather weights per layer", _MEMORY),
        r + "log_prob_micro_batch_size": _no("rows per old-log-prob forward over all GPUs (deprecated)",
                                             "write log_prob_micro_batch_size_per_gpu"),
        r + "log_prob_micro_batch_size_per_gpu": _noop("rows per old-log-prob forward per GPU", "the actor's "
                                                       "micro batch (actor.micro_batch_size) runs them here"),
        r + "log_prob_use_dynamic_bsz": _no("token-budget micro batches", "roles.actor.max_tokens_per_micro_batch"),
        r + "log_prob_max_token_len_per_gpu": _noop("the token budget", "read only with log_prob_use_dynamic_bsz"),
        r + "disable_log_stats": _noop("engine statistics", "the engine's own"),
        r + "do_sample": _no("sample (false: greedy)", "rollouts sample here", (True,)),
        r + "n": _to("algorithm_options.n", "completions per prompt"),
        r + "over_sample_rate": _no("over-sampling", "not supported", (0, 0.0)),
        r + "multi_stage_wake_up": _noop("staged engine wake-up", _MEMORY),
        r + "engine_kwargs.vllm": _conv(lambda v, c: {"roles.actor.rollout_options.engine_args": v} if v else {},
                                        "vLLM engine arguments", "roles.actor.rollout_options.engine_args"),
        r + "engine_kwargs.**": _no("another engine's arguments", "only vLLM is an engine here"),
        r + "val_kwargs.**": _no("validation sampling", "validation samples as training does here",
                                 (None, -1, 1.0, 1, 0, False)),
        r + "router_config_path": _no("an engine router", "not supported"),
        r + "multi_turn.enable": _no("multi-turn rollouts", "agent.environment (docs/agents.md)"),
        r + "multi_turn.**": _noop("multi-turn options", "read only with multi_turn.enable (refused)"),
        r + "calculate_log_probs": _noop("the engine's log-probs", "asked for by algorithm_options."
                                         "rollout_correction here"),
        r + "agent.**": _noop("agent-loop workers", "read only with multi_turn.enable (refused)"),
        r + "checkpoint_engine.**": _noop("how weights reach the engine", "the sync is the backend's"),
        r + "trace.**": _no("rollout tracing", "not supported"),
        r + "skip_tokenizer_init": _noop("engine tokenizer", _MEMORY),
        r + "enable_rollout_routing_replay": _no("MoE routing replay", "not supported"),
        r + "moe_load_balance_metrics_interval": _no("MoE metrics", "not supported"),
        r + "prometheus.enable": _no("Prometheus metrics", "not supported"),
        r + "prometheus.**": _noop("Prometheus options", "read only with prometheus.enable (refused)"),
        r + "quantization": _no("rollout quantisation", "not supported"),
        r + "quantization_config_file": _no("rollout quantisation", "not supported"),
        r + "mtp": _no("speculative decoding", _MTP),
        r + "mtp.**": _noop("speculative decoding options", _MTP),
        r + "disaggregation.enabled": _no("prefill/decode disaggregation", "not supported"),
        r + "disaggregation.**": _noop("disaggregation options", "read only with disaggregation.enabled"),
        r + "qat": _no("quantisation-aware rollouts", "not supported"),
        r + "limit_images": _no("images per prompt", "no multimodal data here"),
        r + "profiler.**": _no("profiler", _PROFILE),
    }


def _critic_keys() -> dict[str, ForeignKey]:
    c = "critic."
    return {
        **_optim_keys(c + "optim.", "critic"),
        **_engine_keys(c),
        **_model_keys(c + "model.", "critic"),
        c + "fsdp.param_offload": _noop("parameter offload", _MEMORY),
        c + "fsdp.optimizer_offload": _noop("optimizer offload", _MEMORY),
        c + "fsdp.**": _no("FSDP engine settings", _FSDP),
        c + "strategy": _conv(_strategy("critic"), "the critic's engine", "roles.critic.backend"),
        c + "enable": _noop("use a critic", "the algorithm decides (ppo has one)"),
        c + "ppo_mini_batch_size": _no("prompts per mini-batch", "critic.mini_batches = data.batch_size / "
                                       "ppo_mini_batch_size", (None,)),
        c + "ppo_micro_batch_size": _no("rows per micro batch over all GPUs (deprecated)",
                                        "write ppo_micro_batch_size_per_gpu (critic.micro_batch_size)"),
        c + "ppo_micro_batch_size_per_gpu": _conv(_unless_null("critic.micro_batch_size"), "rows per pass per GPU",
                                                  "critic.micro_batch_size"),
        c + "forward_micro_batch_size": _no("rows per value forward (deprecated)", "critic.micro_batch_size"),
        c + "forward_micro_batch_size_per_gpu": _noop("rows per value forward per GPU", "critic.micro_batch_size "
                                                      "runs them here"),
        c + "use_dynamic_bsz": _no("token-budget micro batches", "roles.critic.max_tokens_per_micro_batch"),
        c + "ppo_max_token_len_per_gpu": _noop("the token budget", "read only with use_dynamic_bsz (refused)"),
        c + "forward_max_token_len_per_gpu": _noop("the token budget", "read only with use_dynamic_bsz (refused)"),
        c + "ppo_epochs": _to("critic.epochs", "critic updates per batch"),
        c + "shuffle": _no("shuffle mini-batches", "mini-batches keep the batch's order here"),
        c + "data_loader_seed": _noop("the shuffle's seed", "read only with shuffle (refused)"),
        c + "cliprange_value": _conv(_only("value_clip", ("ppo",)), "value clip range", "algorithm_options."
                                     "value_clip (ppo)"),
        c + "loss_agg_mode": _no("the value loss's aggregation", "the value loss is token-mean here",
                                 ("token-mean", None)),
        c + "loss_scale_factor": _no("the value loss's constant", "not used by token-mean"),
        c + "checkpoint.**": _noop("what a checkpoint holds", "everything, always"),
        c + "grad_clip": _to("critic.grad_clip", "gradient-norm clip"),
    }


def _data_keys() -> dict[str, ForeignKey]:
    d = "data."
    return {
        d + "tokenizer": _no("a separate tokenizer", "the model directory's own"),
        d + "use_shm": _noop("load through /dev/shm", _MEMORY),
        d + "train_files": _to("data.path", "train parquet file(s)"),
        d + "val_files": _to("data.val_path", "validation parquet file(s)"),
        d + "train_max_samples": _no("rows kept of the train files", "not supported", (None, -1)),
        d + "val_max_samples": _no("rows kept of the validation files", "not supported", (None, -1)),
        d + "reward_fn_key": _noop("the column naming the reward function", "data_source reaches the reward "
                                   "function as a column"),
        d + "max_response_length": _to("algorithm_options.max_new_tokens", "most tokens per response"),
        d + "train_batch_size": _to("data.batch_size", "prompts per step"),
        d + "val_batch_size": _noop("validation batch (deprecated in verl)", _MEMORY),
        d + "return_raw_input_ids": _noop("a dataset output", "internal to verl"),
        d + "return_raw_chat": _noop("a dataset output", "internal to verl"),
        d + "return_full_prompt": _noop("a dataset output", "internal to verl"),
        d + "shuffle": _no("shuffle the prompts", "prompts are shuffled (seeded) here", (True,)),
        d + "seed": _noop("the shuffle's seed", "seed seeds it here"),
        d + "dataloader_num_workers": _noop("loader processes", _MEMORY),
        d + "validation_shuffle": _noop("shuffle validation", "validation order does not change its numbers"),
        d + "filter_overlong_prompts": _no("drop prompts over max_prompt_length", "always done here (counted)",
                                           (True,)),
        d + "filter_overlong_prompts_workers": _noop("filter processes", _MEMORY),
        d + "truncation": _no("what to do with long prompts", "long prompts are dropped, not truncated",
                              ("error",)),
        d + "image_key": _noop("image column", "read only for multimodal data"),
        d + "video_key": _noop("video column", "read only for multimodal data"),
        d + "audio_key": _noop("audio column", "read only for multimodal data"),
        d + "image_patch_size": _noop("image patches", "read only for multimodal data"),
        d + "trust_remote_code": _no("run a tokenizer's own code", "not supported"),
        d + "custom_cls.path": _no("a dataset class", "not supported: data.path takes jsonl, parquet or a "
                                   "datasets directory"),
        d + "custom_cls.name": _no("a dataset class", "read only with custom_cls.path"),
        d + "return_multi_modal_inputs": _noop("a dataset output", "internal to verl"),
        d + "sampler.class_path": _no("a sampler class", "not supported"),
        d + "sampler.class_name": _no("a sampler class", "not supported"),
        d + "datagen.path": _no("a data generator", "not supported"),
        d + "datagen.name": _no("a data generator", "not supported"),
        d + "apply_chat_template_kwargs": _no("chat template options", "not supported"),
        d + "mm_processor_kwargs": _no("multimodal processor options", "no multimodal data here"),
        d + "tool_config_path": _no("tools", "agent.environment (docs/agents.md)"),
        d + "function_tool_path": _no("tools", "agent.environment (docs/agents.md)"),
        d + "gen_batch_size": _no("prompts per generation round", "dapo's rounds refill the batch"),
    }


def _trainer_keys() -> dict[str, ForeignKey]:
    t = "trainer."
    return {
        t + "balance_batch": _noop("balance tokens over ranks", _MEMORY),
        t + "total_epochs": _conv(_epochs, "passes over the train files", "accepted with total_training_steps; "
                                  "else refused: write trainer.total_training_steps"),
        t + "total_training_steps": _conv(_unless_null("steps"), "steps", "steps"),
        t + "project_name": _noop("the tracker's project", "W&B reads WANDB_PROJECT here"),
        t + "experiment_name": _noop("the tracker's run name", "the run is named after output_dir here"),
        t + "logger": _conv(_logger, "where metrics go", "trackers (console: the progress bar, "
                            "console_metrics_every)"),
        t + "log_val_generations": _to("validation_samples", "validation completions kept"),
        t + "rollout_data_dir": _no("dump rollouts", "not supported (validation_samples.jsonl holds validation's)"),
        t + "validation_data_dir": _noop("dump validation generations", "validation_samples.jsonl in the run dir"),
        t + "nnodes": _conv(_nodes, "nodes", "num_gpus = nnodes x n_gpus_per_node"),
        t + "n_gpus_per_node": _conv(_gpus, "GPUs per node", "num_gpus (x nnodes)"),
        t + "save_freq": _conv(_positive_or_off("checkpoint_every"), "checkpoint every N steps (-1: never)",
                               "checkpoint_every (0: never)"),
        t + "esi_redundant_time": _noop("save before an expiry", "not needed"),
        t + "resume_mode": _no("resume", "hybridflow train --resume", ("auto", "disable")),
        t + "resume_from_path": _no("resume from a checkpoint", "hybridflow train --resume"),
        t + "checkpoint_callback_class": _no("a checkpoint callback", "not supported"),
        t + "val_before_train": _conv(_val_before_train, "validate before the first step", "validate_before_train "
                                      "(with data.val_files)"),
        t + "val_only": _no("validate only", "not supported"),
        t + "test_freq": _conv(_positive_or_off("validation_every"), "validate every N steps (-1: never)",
                               "validation_every (0: never)"),
        t + "critic_warmup": _no("critic-only steps first", "not supported"),
        t + "default_hdfs_dir": _no("copy checkpoints to HDFS", "not supported"),
        t + "del_local_ckpt_after_load": _no("delete a checkpoint after loading", "not supported"),
        t + "default_local_dir": _to("output_dir", "where checkpoints go (the run directory here)"),
        t + "max_actor_ckpt_to_keep": _conv(_unless_null("keep_checkpoints"), "actor checkpoints kept",
                                            "keep_checkpoints"),
        t + "max_critic_ckpt_to_keep": _noop("critic checkpoints kept", "a checkpoint holds every role: "
                                             "keep_checkpoints"),
        t + "ray_wait_register_center_timeout": _noop("Ray start-up deadline", "liveness.* sets the deadlines"),
        t + "device": _noop("the accelerator", "whatever the machine has"),
        t + "use_v1": _noop("verl's trainer version", "internal to verl"),
        t + "use_legacy_worker_impl": _noop("verl's worker version", "internal to verl"),
        t + "v1.trainer_mode": _no("sync or async trainer", "pipeline: sync, one_step_off or async "
                                   "(docs/runtime.md)", ("sync",)),
        t + "v1.**": _noop("options of verl's async trainer modes", "read only with v1.trainer_mode (refused)"),
    }


def _other_keys() -> dict[str, ForeignKey]:
    return {
        "actor_rollout_ref.hybrid_engine": _noop("colocated actor and rollout", "the default plan colocates them"),
        "actor_rollout_ref.nccl_timeout": _noop("collective timeout", "liveness.* sets the deadlines"),
        "algorithm.gamma": _conv(_only("gamma", ("ppo", "reinforce_pp")), "discount", "algorithm_options.gamma "
                                 "(ppo, reinforce_pp; verl reads it only there too)"),
        "algorithm.lam": _conv(_only("lam", ("ppo",)), "GAE lambda", "algorithm_options.lam (ppo)"),
        "algorithm.adv_estimator": _conv(_estimator, "the advantage estimator", "algorithm (gae: ppo; "
                                         "reinforce_plus_plus: reinforce_pp)", first=True),
        "algorithm.norm_adv_by_std_in_grpo": _conv(_only("norm_by_std", ("grpo", "grpo_no_ref")), "divide by the "
                                                   "group std (grpo)", "algorithm_options.norm_by_std"),
        "algorithm.filter_groups.enable": _no("dynamic sampling", "algorithm dapo (its max_rounds)"),
        "algorithm.filter_groups.**": _noop("dynamic sampling options", "read only with filter_groups.enable"),
        "algorithm.use_kl_in_reward": _conv(_kl_in_reward, "KL as a reward penalty", "implied by the algorithm "
                                            "(ppo, rloo, remax, reinforce_pp)"),
        "algorithm.kl_penalty": _conv(_kl_type, "the KL estimator in the reward", "accepted at k3 (low_var_kl)"),
        "algorithm.kl_ctrl.type": _conv(_kl_control, "fixed or adaptive KL", "adaptive: algorithm_options."
                                        "kl_target and kl_horizon (ppo)"),
        "algorithm.kl_ctrl.kl_coef": _conv(_kl_reward_coef, "the KL reward coefficient", "algorithm_options."
                                           "kl_coef (ppo, rloo, remax, reinforce_pp)"),
        "algorithm.kl_ctrl.horizon": _noop("adaptive KL horizon", "part of kl_ctrl.type's translation"),
        "algorithm.kl_ctrl.target_kl": _noop("adaptive KL target", "part of kl_ctrl.type's translation"),
        "algorithm.use_pf_ppo": _no("preference-feedback PPO", "not built in"),
        "algorithm.pf_ppo.**": _noop("PF-PPO options", "read only with use_pf_ppo (refused)"),
        "algorithm.rollout_correction.rollout_is": _no("importance-sampling correction", "algorithm_options."
                                                       "rollout_correction: tis"),
        "algorithm.rollout_correction.**": _noop("correction options", "read only with rollout_is (refused)"),
        "custom_reward_function.path": _conv(_reward("custom_reward_function."), "the reward file",
                                             "data.reward: path:name"),
        "custom_reward_function.name": _noop("the reward function's name", "part of data.reward (path:name)"),
        "custom_reward_function.reward_kwargs": _no("extra reward arguments", "not supported"),
        "reward.custom_reward_function.path": _conv(_reward("reward.custom_reward_function."), "the reward file",
                                                    "data.reward: path:name"),
        "reward.custom_reward_function.name": _noop("the reward function's name", "part of data.reward"),
        "reward.num_workers": _noop("reward processes", _MEMORY),
        "reward.reward_manager.**": _no("a reward manager", "the reward functions run as data.reward says",
                                        ("register", "naive", None, "custom_reward_manager")),
        "reward.reward_model.enable": _no("a reward model", "a reward_model role with a local model (roles)"),
        "reward.reward_model.**": _noop("reward-model options", "read only with reward_model.enable (refused)"),
        "reward.sandbox_fusion.**": _no("a code sandbox", "not supported", (None, 64, 1024)),
        "reward_model.enable": _no("a reward model", "a reward_model role with a local model (roles)"),
        "reward_model.**": _noop("reward-model options", "read only with reward_model.enable (refused)"),
        "sandbox_fusion.**": _no("a code sandbox", "not supported"),
        "global_profiler.**": _no("profiler", _PROFILE),
        "ray_kwargs.**": _no("ray.init arguments", "ray_address; Ray's own environment variables"),
        "transfer_queue.enable": _no("verl's transfer queue", "not supported"),
        "transfer_queue.**": _noop("transfer-queue options", "read only with transfer_queue.enable (refused)"),
        "distillation.enabled": _no("distillation", "not supported"),
        "distillation.**": _noop("distillation options", "read only with distillation.enabled (refused)"),
        "skip.**": _no("replay dumped rollouts", "not supported"),
        "**._target_": _noop("Hydra's class to build", "there is no Hydra here"),
    }


@functools.cache
def table() -> dict[str, ForeignKey]:
    """Every verl key and ``**`` pattern with its entry."""
    return {**_actor_keys(), **_ref_keys(), **_rollout_keys(), **_model_keys(MODEL, "actor"), **_critic_keys(),
            **_data_keys(), **_trainer_keys(), **_other_keys()}


def _matches(pattern: str, key: str) -> bool:
    if pattern.startswith("**."):
        return key.endswith(pattern[2:]) or key == pattern[3:]
    if pattern.endswith(".**"):
        return key.startswith(pattern[:-2])
    return pattern == key


def verl_key(key: str) -> tuple[str, ForeignKey] | None:
    """``(full verl key, entry)`` for ``key``: the verl key itself, the one verl key it is a dotted suffix of,
    or the most specific ``**`` pattern it falls under; None when it is not verl's."""
    entries = table()
    if key in entries and "**" not in key:
        return key, entries[key]
    exact = [k for k in entries if "**" not in k and k.endswith("." + key)]
    if len(exact) == 1:
        return exact[0], entries[exact[0]]
    patterns = [p for p in entries if "**" in p and _matches(p, key)]
    if patterns:
        best = max(patterns, key=len)
        return key, entries[best]
    return None


def documented_verl_keys() -> list[tuple[str, ForeignKey]]:
    """The rows docs/migrating.md lists: every verl key and pattern, in the table's order."""
    return [(f"`{key}`", entry) for key, entry in table().items()]
