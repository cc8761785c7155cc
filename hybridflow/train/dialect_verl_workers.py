"""verl 0.9's worker keys (``actor_rollout_ref.actor|ref|rollout|model.*``, ``critic.*``) as config keys: the
half of :mod:`hybridflow.train.dialect_verl`'s table that configures the models, their optimisers and engines.
"""

from __future__ import annotations

from typing import Any

from hybridflow.train.foreign_keys import (
    KL_LOSS,
    MEMORY_ONLY,
    Context,
    ForeignKey,
    Refused,
    accepted,
    refused,
    renamed,
    translated,
    unless_null,
)

ACTOR = "actor_rollout_ref.actor."
ROLLOUT = "actor_rollout_ref.rollout."
MODEL = "actor_rollout_ref.model."


def _use_kl_loss(value: Any, context: Context) -> dict[str, Any]:
    algorithm = context["algorithm"]
    if algorithm in KL_LOSS:
        return {} if value else {"algorithm.options.kl_coef": 0.0}
    if value:
        raise Refused(f"algorithm {algorithm!r} has no KL loss term (grpo, dr_grpo, gspo have)")
    return {}


def _kl_loss_coef(value: Any, context: Context) -> dict[str, Any]:
    if context["algorithm"] not in KL_LOSS or context.get(ACTOR + "use_kl_loss") is False:
        return {}  # verl reads it only with use_kl_loss, which these algorithms imply
    return {"algorithm.options.kl_coef": value}


def kl_estimator(value: Any, context: Context) -> dict[str, Any]:
    if value in ("low_var_kl", "k3"):
        return {}
    raise Refused("the built-in KL loss term is k3 (low_var_kl); another estimator needs your own graph "
                  "(ppo_policy's kl_type, docs/algorithms.md)")


def _mini_batches(role: str) -> Any:
    """verl's mini-batch size (prompts) as our count of mini-batches per step, from the step's prompts."""
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if value is None:
            return {}
        prompts = context.get("data.train_batch_size", context.get("data.batch_size"))
        if not isinstance(prompts, int) or not isinstance(value, int) or value < 1 or prompts % value:
            raise Refused(f"here {role}.mini_batches is how many mini-batches a step's batch is cut into: give "
                          f"data.train_batch_size (a multiple of it), or write {role}.mini_batches = "
                          "data.batch_size / ppo_mini_batch_size")
        return {f"{role}.mini_batches": prompts // value}
    return convert


def _strategy(role: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if value in ("fsdp", "fsdp2"):
            return {f"roles.{role}.backend": "fsdp"}
        raise Refused("the training backends are torch, fsdp and deepspeed (roles.<name>.backend)")
    return convert


def _rollout_name(value: Any, context: Context) -> dict[str, Any]:
    engines = {"vllm": "vllm", "hf": "hf_generate"}
    if value not in engines:
        raise Refused("the rollout engines are native, hf_generate, vllm, server (roles.actor.rollout)")
    return {"roles.actor.rollout": engines[value]}


def _vllm_option(name: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if context.get(ROLLOUT + "name") != "vllm" or value is None:
            return {}  # an engine setting: only vLLM's is ours
        return {f"roles.actor.rollout_options.{name}": value}
    return convert


def _top_k(value: Any, context: Context) -> dict[str, Any]:
    return {"algorithm.options.top_k": 0 if value == -1 else value}  # verl's -1 is our 0: off


def _loss_mode(value: Any, context: Context) -> dict[str, Any]:
    if value == "vanilla":
        return {}
    if value == "gspo":
        return {"algorithm.name": "gspo"}
    raise Refused("the built-in policy losses are vanilla (PPO clip) and gspo (algorithm gspo)")


def _warmup_steps(value: Any, context: Context) -> dict[str, Any]:
    return {} if value in (-1, None) else {"optim.actor.warmup_steps": value}  # -1: use the ratio


def _scheduler(target: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if value is None:
            return {}
        if value not in ("constant", "cosine"):
            raise Refused("verl's schedules are constant and cosine; here optim.actor.lr_scheduler")
        return {target: value}
    return convert


def only_for(option: str, algorithms: tuple[str, ...]) -> Any:
    """An option of some algorithms; verl reads it only for those too, so elsewhere it changes nothing."""
    def convert(value: Any, context: Context) -> dict[str, Any]:
        return {f"algorithm.options.{option}": value} if context["algorithm"] in algorithms else {}
    return convert


NO_PROFILER = "no profiler hooks here; per-node times are in the step metrics (time/*)"
_FSDP = "verl's engine setting; here roles.<name>.backend (torch, fsdp, deepspeed) with roles.<name>.options"
_MTP = "multi-token prediction is not supported"
_LORA = "LoRA is roles.actor.lora (rank, alpha, dropout, target_modules)"


def _engine_keys(prefix: str) -> dict[str, ForeignKey]:
    """Settings verl's actor, reference and critic share: engine, micro batches, kernels, checkpoints."""
    return {
        prefix + "fsdp_config.param_offload": accepted("parameter offload", MEMORY_ONLY),
        prefix + "fsdp_config.optimizer_offload": accepted("optimizer offload", MEMORY_ONLY),
        prefix + "fsdp_config.**": refused("FSDP engine settings", _FSDP),
        prefix + "ulysses_sequence_parallel_size": refused("sequence parallelism", "not supported", (1,)),
        prefix + "entropy_from_logits_with_chunking": accepted("chunked entropy", MEMORY_ONLY),
        prefix + "entropy_from_logits_chunk_size": accepted("chunked entropy", MEMORY_ONLY),
        prefix + "entropy_checkpointing": accepted("entropy recomputation", MEMORY_ONLY),
        prefix + "use_torch_compile": accepted("torch.compile", MEMORY_ONLY),
        prefix + "pad_to_length": accepted("pad to fixed lengths", MEMORY_ONLY),
        prefix + "rollout_n": accepted("a copy of rollout.n", "verl fills it in"),
        prefix + "profiler.**": refused("profiler", NO_PROFILER),
    }


def _model_keys(prefix: str, role: str) -> dict[str, ForeignKey]:
    keys = {
        prefix + "hf_config_path": refused("a separate config.json", "the model directory's own"),
        prefix + "tokenizer_path": refused("a separate tokenizer", "the model directory's own"),
        prefix + "use_shm": accepted("load through /dev/shm", MEMORY_ONLY),
        prefix + "trust_remote_code": refused("run a model's own code", "not supported"),
        prefix + "custom_chat_template": refused("a chat template", "the tokenizer's own"),
        prefix + "external_lib": refused("import a library for the model", "not supported"),
        prefix + "override_config": refused("config.json overrides", "not supported"),
        prefix + "enable_gradient_checkpointing": accepted("activation recomputation", MEMORY_ONLY),
        prefix + "enable_activation_offload": accepted("activation offload", MEMORY_ONLY),
        prefix + "use_remove_padding": accepted("padding-free forwards",
                                                "sequences are packed here (pipeline.padding: false)"),
        prefix + "lora_rank": refused("LoRA rank", _LORA),
        prefix + "lora_alpha": accepted("LoRA alpha", "read only with lora_rank > 0 (refused)"),
        prefix + "target_modules": accepted("LoRA modules", "read only with lora_rank > 0 (refused)"),
        prefix + "exclude_modules": refused("LoRA modules left out", _LORA),
        prefix + "lora_adapter_path": refused("a LoRA adapter to start from", "not supported"),
        prefix + "use_liger": refused("Liger kernels", "not supported"),
        prefix + "use_fused_kernels": refused("fused kernels", "not supported"),
        prefix + "fused_kernel_options.**": accepted("fused kernel options", "read only with use_fused_kernels"),
        prefix + "tiled_mlp.enabled": refused("tiled MLP", "not supported"),
        prefix + "tiled_mlp.num_shards": accepted("tiled MLP shards", "read only with tiled_mlp.enabled"),
        prefix + "mtp.enable": refused("multi-token prediction", _MTP),
        prefix + "mtp.**": accepted("multi-token prediction options", "read only with mtp.enable (refused)"),
        prefix + "lora.rank": refused("Megatron LoRA rank", _LORA),
        prefix + "lora.**": accepted("Megatron LoRA options", "read only with lora.rank > 0 (refused)"),
    }
    if role == "actor":
        keys[prefix + "path"] = renamed("model.path", "the policy's HF directory")
    else:
        keys[prefix + "path"] = renamed(f"roles.{role}.model", "the critic's HF directory")
    return keys


def _optim_keys(prefix: str, ours: str) -> dict[str, ForeignKey]:
    return {
        prefix + "lr": renamed(f"{ours}.lr", "learning rate"),
        prefix + "lr_warmup_steps_ratio": renamed(f"{ours}.warmup_ratio", "warmup as a ratio of the steps"),
        prefix + "lr_warmup_steps": translated(_warmup_steps, "warmup steps (-1: use the ratio)",
                                               f"{ours}.warmup_steps"),
        prefix + "total_training_steps": accepted("the schedule's length", "verl fills it in; here the run's steps"),
        prefix + "weight_decay": renamed(f"{ours}.weight_decay", "AdamW weight decay"),
        prefix + "betas": renamed(f"{ours}.betas", "AdamW betas"),
        prefix + "clip_grad": renamed(f"{ours}.grad_clip", "gradient-norm clip"),
        prefix + "min_lr_ratio": renamed(f"{ours}.min_lr_ratio", "the cosine schedule's floor"),
        prefix + "num_cycles": refused("cosine cycles", "the cosine schedule here is one half cycle", (0.5,)),
        prefix + "lr_scheduler_type": translated(_scheduler(f"{ours}.lr_scheduler"), "the schedule",
                                            f"{ours}.lr_scheduler"),
        prefix + "warmup_style": translated(_scheduler(f"{ours}.lr_scheduler"), "the schedule (deprecated name)",
                                       f"{ours}.lr_scheduler"),
        prefix + "optimizer": refused("the optimizer", "the optimizer here is torch AdamW", ("AdamW",)),
        prefix + "optimizer_impl": refused("the optimizer's module", "the optimizer here is torch AdamW",
                                       ("torch.optim",)),
        prefix + "zero_indexed_step": refused("the schedule's first step", "the schedule counts from 0 here", (True,)),
        prefix + "override_optimizer_config": refused("optimizer overrides", "not supported"),
    }


def _actor_keys() -> dict[str, ForeignKey]:
    a = ACTOR
    return {
        **_optim_keys(a + "optim.", "optim.actor"),
        **_engine_keys(a),
        a + "strategy": translated(_strategy("actor"), "the training engine", "roles.actor.backend"),
        a + "ppo_mini_batch_size": translated(_mini_batches("optim.actor"), "prompts per mini-batch",
                                              "optim.actor.mini_batches (a count) = data.train_batch_size / "
                                              "ppo_mini_batch_size"),
        a + "ppo_micro_batch_size": refused("rows per micro batch over all GPUs (deprecated)",
                                        "write ppo_micro_batch_size_per_gpu (optim.actor.micro_batch_size)"),
        a + "ppo_micro_batch_size_per_gpu": translated(unless_null("optim.actor.micro_batch_size"), "rows per forward/"
                                                  "backward pass per GPU", "optim.actor.micro_batch_size"),
        a + "use_dynamic_bsz": refused("token-budget micro batches", "write roles.actor.max_tokens_per_micro_batch "
                                   "(= ppo_max_token_len_per_gpu)"),
        a + "ppo_max_token_len_per_gpu": accepted("the token budget", "read only with use_dynamic_bsz (refused)"),
        a + "clip_ratio": renamed("algorithm.options.clip_ratio", "PPO clip range"),
        a + "clip_ratio_low": renamed("algorithm.options.clip_ratio", "lower clip range"),
        a + "clip_ratio_high": renamed("algorithm.options.clip_ratio_high", "upper clip range"),
        a + "clip_ratio_c": refused("dual-clip bound (always on in verl)", "the built-in algorithms do not dual-clip; "
                                "ppo_policy's dual_clip in your own graph (docs/algorithms.md)", ()),
        a + "tau_pos": accepted("SAPO option", "read only with policy_loss.loss_mode sapo (refused)"),
        a + "tau_neg": accepted("SAPO option", "read only with policy_loss.loss_mode sapo (refused)"),
        a + "freeze_vision_tower": renamed("roles.actor.freeze_vision_tower", "freeze the vision tower (default false "
                                                                     "in both)"),
        a + "policy_loss.loss_mode": translated(_loss_mode, "the policy loss", "vanilla accepted; gspo: algorithm gspo",
                                           first=True),
        a + "policy_loss.**": accepted("options of other policy losses", "read only by loss modes that are refused"),
        a + "loss_agg_mode": renamed("algorithm.options.loss_agg", "loss aggregation (same mode names)"),
        a + "loss_scale_factor": translated(unless_null("algorithm.options.loss_scale_factor"),
                                            "seq-mean-token-sum-norm"
                                       "'s constant", "algorithm.options.loss_scale_factor"),
        a + "entropy_coeff": renamed("algorithm.options.entropy_coef", "entropy bonus"),
        a + "calculate_entropy": accepted("compute the entropy", "actor/entropy is always logged here"),
        a + "calculate_sum_pi_squared": refused("sum of squared probabilities", "not computed here"),
        a + "use_kl_loss": translated(_use_kl_loss, "KL to the reference in the loss", "implied by the algorithm "
                                 "(grpo, dr_grpo, gspo); false: algorithm.options.kl_coef 0"),
        a + "use_prefix_grouper": refused("shared-prefix forwards", "not supported"),
        a + "kl_loss_coef": translated(_kl_loss_coef, "the KL loss coefficient", "algorithm.options.kl_coef (in grpo, "
                                  "dr_grpo, gspo; dropped with use_kl_loss: false)"),
        a + "kl_loss_type": translated(kl_estimator, "the KL estimator",
                                       "accepted at low_var_kl (k3, ours); else refused"),
        a + "ppo_epochs": renamed("optim.actor.epochs", "updates per batch"),
        a + "shuffle": refused("shuffle mini-batches", "mini-batches keep the batch's order here"),
        a + "data_loader_seed": accepted("the mini-batch shuffle's seed", "read only with shuffle (refused)"),
        a + "checkpoint.save_contents": accepted("what a checkpoint holds", "model, optimizer and state, always"),
        a + "checkpoint.load_contents": accepted("what a resume loads", "all of it (--resume)"),
        a + "checkpoint.async_save": refused("asynchronous checkpoints", "not supported"),
        a + "checkpoint.strict": accepted("strict checkpoint loading", "always strict here"),
        a + "use_fused_kernels": refused("fused kernels", "not supported"),
        a + "qat.enable": refused("quantisation-aware training", "not supported"),
        a + "qat.**": accepted("QAT options", "read only with qat.enable (refused)"),
        a + "grad_clip": renamed("optim.actor.grad_clip", "gradient-norm clip"),
        a + "use_remove_padding": accepted("padding-free forwards",
                                           "sequences are packed here (pipeline.padding: false)"),
        a + "router_replay.mode": refused("MoE router replay", "not supported", ("disabled",)),
        a + "router_replay.**": accepted("router replay options", "read only with router_replay.mode (refused)"),
    }


def _ref_keys() -> dict[str, ForeignKey]:
    r = "actor_rollout_ref.ref."
    return {
        **_engine_keys(r),
        r + "strategy": accepted("the reference's engine", "the reference runs on the policy's backend"),
        r + "log_prob_micro_batch_size": refused("rows per reference forward over all GPUs (deprecated)",
                                             "write log_prob_micro_batch_size_per_gpu"),
        r + "log_prob_micro_batch_size_per_gpu": translated(unless_null("roles.reference.micro_batch_size"), "rows per "
                                                       "reference forward per GPU", "roles.reference.micro_batch_size"),
        r + "log_prob_use_dynamic_bsz": refused("token-budget micro batches",
                                                "roles.reference.max_tokens_per_micro_batch"),
        r + "log_prob_max_token_len_per_gpu": accepted("the token budget", "read only with log_prob_use_dynamic_bsz"),
    }


def _rollout_keys() -> dict[str, ForeignKey]:
    r = ROLLOUT
    return {
        r + "name": translated(_rollout_name, "the rollout engine", "roles.actor.rollout (vllm; hf: hf_generate)"),
        r + "mode": accepted("sync or async engine calls", "the engine's own"),
        r + "nnodes": accepted("rollout nodes", "placement is a plan here (docs/planner.md)"),
        r + "n_gpus_per_node": accepted("rollout GPUs per node", "placement is a plan here (docs/planner.md)"),
        r + "temperature": renamed("algorithm.options.temperature", "sampling temperature"),
        r + "top_k": translated(_top_k, "top-k sampling (-1: off)", "algorithm.options.top_k (0: off)"),
        r + "top_p": renamed("algorithm.options.top_p", "nucleus sampling"),
        r + "full_determinism": refused("deterministic sampling", "not supported"),
        r + "seed": accepted("the engine's seed", "seed seeds the engine here"),
        r + "prompt_length": accepted("the engine's prompt budget", "data.max_prompt_length"),
        r + "response_length": accepted("the engine's response budget", "data.max_response_length"),
        r + "dtype": accepted("the engine's dtype", "roles.actor.rollout_options.dtype"),
        r + "gpu_memory_utilization": translated(_vllm_option("gpu_memory_utilization"), "vLLM's memory share",
                                            "roles.actor.rollout_options.gpu_memory_utilization (vllm)"),
        r + "ignore_eos": refused("sample past the end token", "not supported"),
        r + "enforce_eager": accepted("no CUDA graphs", MEMORY_ONLY),
        r + "cudagraph_capture_sizes": accepted("CUDA graph sizes", MEMORY_ONLY),
        r + "free_cache_engine": accepted("free the KV cache between rollouts", MEMORY_ONLY),
        r + "tensor_model_parallel_size": translated(_vllm_option("tensor_parallel_size"), "rollout tensor parallelism",
                                                "roles.actor.rollout_options.tensor_parallel_size (vllm)"),
        r + "data_parallel_size": accepted("rollout replicas", "placement is a plan here"),
        r + "expert_parallel_size": refused("rollout expert parallelism", "not supported", (1,)),
        r + "pipeline_model_parallel_size": refused("rollout pipeline parallelism", "not supported", (1,)),
        r + "max_num_batched_tokens": accepted("engine batching", MEMORY_ONLY),
        r + "max_model_len": translated(_vllm_option("max_model_len"), "the engine's context",
                                   "roles.actor.rollout_options.max_model_len (vllm)"),
        r + "max_num_seqs": accepted("engine batching", MEMORY_ONLY),
        r + "enable_chunked_prefill": accepted("chunked prefill", MEMORY_ONLY),
        r + "enable_prefix_caching": accepted("prefix caching", MEMORY_ONLY),
        r + "logprobs_mode": accepted("what the engine's log-probs are", "rollout log-probs are of the raw logits "
                                   "here (docs/algorithms.md)"),
        r + "scheduling_policy": accepted("engine scheduling", MEMORY_ONLY),
        r + "load_format": accepted("how the engine loads weights", "weights are synced from the trainer"),
        r + "layered_summon": accepted("gather weights per layer", MEMORY_ONLY),
        r + "log_prob_micro_batch_size": refused("rows per old-log-prob forward over all GPUs (deprecated)",
                                             "write log_prob_micro_batch_size_per_gpu"),
        r + "log_prob_micro_batch_size_per_gpu": accepted("rows per old-log-prob forward per GPU", "the actor's "
                                                       "micro batch (optim.actor.micro_batch_size) runs them here"),
        r + "log_prob_use_dynamic_bsz": refused("token-budget micro batches", "roles.actor.max_tokens_per_micro_batch"),
        r + "log_prob_max_token_len_per_gpu": accepted("the token budget", "read only with log_prob_use_dynamic_bsz"),
        r + "disable_log_stats": accepted("engine statistics", "the engine's own"),
        r + "do_sample": refused("sample (false: greedy)", "rollouts sample here", (True,)),
        r + "n": renamed("algorithm.options.n", "completions per prompt"),
        r + "over_sample_rate": refused("over-sampling", "not supported", (0, 0.0)),
        r + "multi_stage_wake_up": accepted("staged engine wake-up", MEMORY_ONLY),
        r + "engine_kwargs.vllm": translated(lambda v, c: {"roles.actor.rollout_options.engine_args": v} if v else {},
                                        "vLLM engine arguments", "roles.actor.rollout_options.engine_args"),
        r + "engine_kwargs.**": refused("another engine's arguments", "only vLLM is an engine here"),
        r + "val_kwargs.**": refused("validation sampling", "validation samples as training does here",
                                 (None, -1, 1.0, 1, 0, False)),
        r + "router_config_path": refused("an engine router", "not supported"),
        r + "multi_turn.enable": refused("multi-turn rollouts", "agent.environment (docs/agents.md)"),
        r + "multi_turn.**": accepted("multi-turn options", "read only with multi_turn.enable (refused)"),
        r + "calculate_log_probs": accepted("the engine's log-probs", "asked for by algorithm.options."
                                         "rollout_correction here"),
        r + "agent.**": accepted("agent-loop workers", "read only with multi_turn.enable (refused)"),
        r + "checkpoint_engine.**": accepted("how weights reach the engine", "the sync is the backend's"),
        r + "trace.**": refused("rollout tracing", "not supported"),
        r + "skip_tokenizer_init": accepted("engine tokenizer", MEMORY_ONLY),
        r + "enable_rollout_routing_replay": refused("MoE routing replay", "not supported"),
        r + "moe_load_balance_metrics_interval": refused("MoE metrics", "not supported"),
        r + "prometheus.enable": refused("Prometheus metrics", "not supported"),
        r + "prometheus.**": accepted("Prometheus options", "read only with prometheus.enable (refused)"),
        r + "quantization": refused("rollout quantisation", "not supported"),
        r + "quantization_config_file": refused("rollout quantisation", "not supported"),
        r + "mtp": refused("speculative decoding", _MTP),
        r + "mtp.**": accepted("speculative decoding options", _MTP),
        r + "disaggregation.enabled": refused("prefill/decode disaggregation", "not supported"),
        r + "disaggregation.**": accepted("disaggregation options", "read only with disaggregation.enabled"),
        r + "qat": refused("quantisation-aware rollouts", "not supported"),
        r + "limit_images": refused("images per prompt", "no multimodal data here"),
        r + "profiler.**": refused("profiler", NO_PROFILER),
    }


def _critic_keys() -> dict[str, ForeignKey]:
    c = "critic."
    return {
        **_optim_keys(c + "optim.", "optim.critic"),
        **_engine_keys(c),
        **_model_keys(c + "model.", "critic"),
        c + "fsdp.param_offload": accepted("parameter offload", MEMORY_ONLY),
        c + "fsdp.optimizer_offload": accepted("optimizer offload", MEMORY_ONLY),
        c + "fsdp.**": refused("FSDP engine settings", _FSDP),
        c + "strategy": translated(_strategy("critic"), "the critic's engine", "roles.critic.backend"),
        c + "enable": accepted("use a critic", "the algorithm decides (ppo has one)"),
        c + "ppo_mini_batch_size": translated(_mini_batches("optim.critic"), "prompts per mini-batch",
                                              "optim.critic.mini_batches = data.train_batch_size / "
                                              "ppo_mini_batch_size"),
        c + "ppo_micro_batch_size": refused("rows per micro batch over all GPUs (deprecated)",
                                        "write ppo_micro_batch_size_per_gpu (optim.critic.micro_batch_size)"),
        c + "ppo_micro_batch_size_per_gpu": translated(unless_null("optim.critic.micro_batch_size"),
                                                  "rows per pass per GPU", "optim.critic.micro_batch_size"),
        c + "forward_micro_batch_size": refused("rows per value forward (deprecated)", "optim.critic.micro_batch_size"),
        c + "forward_micro_batch_size_per_gpu": accepted("rows per value forward per GPU",
                                                      "optim.critic.micro_batch_size runs them here"),
        c + "use_dynamic_bsz": refused("token-budget micro batches", "roles.critic.max_tokens_per_micro_batch"),
        c + "ppo_max_token_len_per_gpu": accepted("the token budget", "read only with use_dynamic_bsz (refused)"),
        c + "forward_max_token_len_per_gpu": accepted("the token budget", "read only with use_dynamic_bsz (refused)"),
        c + "ppo_epochs": renamed("optim.critic.epochs", "critic updates per batch"),
        c + "shuffle": refused("shuffle mini-batches", "mini-batches keep the batch's order here"),
        c + "data_loader_seed": accepted("the shuffle's seed", "read only with shuffle (refused)"),
        c + "cliprange_value": translated(only_for("value_clip", ("ppo",)), "value clip range", "algorithm.options."
                                     "value_clip (ppo)"),
        c + "loss_agg_mode": refused("the value loss's aggregation", "the value loss is token-mean here",
                                 ("token-mean", None)),
        c + "loss_scale_factor": refused("the value loss's constant", "not used by token-mean"),
        c + "checkpoint.**": accepted("what a checkpoint holds", "everything, always"),
        c + "grad_clip": renamed("optim.critic.grad_clip", "gradient-norm clip"),
    }


def worker_keys() -> dict[str, ForeignKey]:
    """The actor's, reference's, rollout's, policy model's and critic's keys."""
    return {**_actor_keys(), **_ref_keys(), **_rollout_keys(), **_model_keys(MODEL, "actor"), **_critic_keys()}
