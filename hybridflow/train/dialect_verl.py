"""verl 0.9's trainer keys (``verl/trainer/config/ppo_trainer.yaml`` with its Hydra defaults) as config keys,
one row each: renamed to ours, translated, accepted as a no-op or refused saying why, read by
:mod:`hybridflow.train.dialects` (:data:`VERL`; the worker keys are in :mod:`hybridflow.train.dialect_verl_workers`).

Keys are verl's full dotted paths; a dotted suffix of one works too (``rollout.n``, ``actor.optim.lr``) when it
names one verl key. Whole subtrees share an entry through a ``**`` pattern (``global_profiler.**``).
tests/train/test_dialects.py checks every key of verl 0.9.1's generated trainer config is classified here.
"""

from __future__ import annotations

from typing import Any

from hybridflow.train.dialect_verl_workers import NO_PROFILER, kl_estimator, only_for, worker_keys
from hybridflow.train.dialects import Dialect
from hybridflow.train.foreign_keys import (
    KL_LOSS,
    KL_REWARD,
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

ESTIMATORS = {"gae": "ppo", "grpo": "grpo", "rloo": "rloo", "remax": "remax", "reinforce_plus_plus": "reinforce_pp",
              "reinforce_plus_plus_baseline": "reinforce_pp_baseline"}


def _estimator(value: Any, context: Context) -> dict[str, Any]:
    if value not in ESTIMATORS:
        raise Refused(f"the built-in algorithms are {sorted(ESTIMATORS)} (verl's names) or ours: algorithm: ...")
    return {"algorithm.name": ESTIMATORS[value]}


def _kl_in_reward(value: Any, context: Context) -> dict[str, Any]:
    algorithm = context["algorithm"]
    if bool(value) == (algorithm in KL_REWARD):
        return {}
    where = "in the reward" if algorithm in KL_REWARD else "in the loss" if algorithm in KL_LOSS else "nowhere"
    raise Refused(f"algorithm {algorithm!r} puts KL {where}: that is fixed by the algorithm here")


def _kl_reward_coef(value: Any, context: Context) -> dict[str, Any]:
    if context["algorithm"] in KL_REWARD:
        return {"algorithm.options.kl_coef": value}
    return {}  # read by verl only with use_kl_in_reward, which is the algorithm's here


def _epochs(value: Any, context: Context) -> dict[str, Any]:
    if context.get("trainer.total_training_steps") is not None:
        return {}  # verl ignores the epochs when the step count is given
    raise Refused("here runs count steps: write trainer.total_training_steps (= total_epochs x rows / "
                  "train_batch_size)")


def _gpus(value: Any, context: Context) -> dict[str, Any]:
    nodes = context.get("trainer.nnodes", 1)
    return {"placement.num_gpus": value * nodes if isinstance(nodes, int) else value}


def _nodes(value: Any, context: Context) -> dict[str, Any]:
    if value == 1 or "trainer.n_gpus_per_node" in context:
        return {}  # folded into placement.num_gpus
    raise Refused("give trainer.n_gpus_per_node too: placement.num_gpus = nnodes x n_gpus_per_node "
                  "(executor.name: ray)")


def _logger(value: Any, context: Context) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    trackers = [n for n in names if n != "console"]  # the console shows a progress bar (logging.console_every)
    unknown = sorted(set(trackers) - {"tensorboard", "wandb", "mlflow"})
    if unknown:
        raise Refused(f"{unknown} have no tracker here; the trackers are tensorboard, wandb, mlflow")
    return {"logging.trackers": trackers}


def _val_before_train(value: Any, context: Context) -> dict[str, Any]:
    if value and not (context.get("data.val_files") or context.get("data.val_path")):
        return {}  # verl validates only with a validation set (its default is true): nothing to validate
    return {"validation.before_train": bool(value)}


def _reward(section: str) -> Any:
    def convert(value: Any, context: Context) -> dict[str, Any]:
        if value is None:
            return {}
        return {"data.reward": f"{value}:{context.get(section + 'name') or 'compute_score'}"}
    return convert


def _kl_control(value: Any, context: Context) -> dict[str, Any]:
    if value == "fixed":
        return {}
    if value == "adaptive" and context["algorithm"] == "ppo":
        return {"algorithm.options.kl_target": context.get("algorithm.kl_ctrl.target_kl", 0.1),
                "algorithm.options.kl_horizon": context.get("algorithm.kl_ctrl.horizon", 10000)}
    raise Refused("fixed, or adaptive with algorithm ppo (algorithm.options.kl_target)")


def _positive_or_off(target: str) -> Any:
    return lambda value, context: {target: 0 if value is None or value < 0 else value}  # verl's -1: never


def _data_keys() -> dict[str, ForeignKey]:
    d = "data."
    return {
        d + "tokenizer": refused("a separate tokenizer", "the model directory's own"),
        d + "use_shm": accepted("load through /dev/shm", MEMORY_ONLY),
        d + "train_files": renamed("data.path", "train parquet file(s)"),
        d + "val_files": renamed("data.val_path", "validation parquet file(s)"),
        d + "train_max_samples": refused("rows kept of the train files", "not supported", (None, -1)),
        d + "val_max_samples": refused("rows kept of the validation files", "not supported", (None, -1)),
        d + "reward_fn_key": accepted("the column naming the reward function", "data_source reaches the reward "
                                   "function as a column"),
        d + "max_response_length": renamed("algorithm.options.max_new_tokens", "most tokens per response"),
        d + "train_batch_size": renamed("data.batch_size", "prompts per step"),
        d + "val_batch_size": accepted("validation batch (deprecated in verl)", MEMORY_ONLY),
        d + "return_raw_input_ids": accepted("a dataset output", "internal to verl"),
        d + "return_raw_chat": accepted("a dataset output", "internal to verl"),
        d + "return_full_prompt": accepted("a dataset output", "internal to verl"),
        d + "shuffle": refused("shuffle the prompts", "prompts are shuffled (seeded) here", (True,)),
        d + "seed": accepted("the shuffle's seed", "seed seeds it here"),
        d + "dataloader_num_workers": accepted("loader processes", MEMORY_ONLY),
        d + "validation_shuffle": accepted("shuffle validation", "validation order does not change its numbers"),
        d + "filter_overlong_prompts": refused("drop prompts over max_prompt_length", "always done here (counted)",
                                           (True,)),
        d + "filter_overlong_prompts_workers": accepted("filter processes", MEMORY_ONLY),
        d + "truncation": refused("what to do with long prompts", "long prompts are dropped, not truncated",
                              ("error",)),
        d + "image_key": accepted("image column", "read only for multimodal data"),
        d + "video_key": accepted("video column", "read only for multimodal data"),
        d + "audio_key": accepted("audio column", "read only for multimodal data"),
        d + "image_patch_size": accepted("image patches", "read only for multimodal data"),
        d + "trust_remote_code": refused("run a tokenizer's own code", "not supported"),
        d + "custom_cls.path": refused("a dataset class", "not supported: data.path takes jsonl, parquet or a "
                                   "datasets directory"),
        d + "custom_cls.name": refused("a dataset class", "read only with custom_cls.path"),
        d + "return_multi_modal_inputs": accepted("a dataset output", "internal to verl"),
        d + "sampler.class_path": refused("a sampler class", "not supported"),
        d + "sampler.class_name": refused("a sampler class", "not supported"),
        d + "datagen.path": refused("a data generator", "not supported"),
        d + "datagen.name": refused("a data generator", "not supported"),
        d + "apply_chat_template_kwargs": refused("chat template options", "not supported"),
        d + "mm_processor_kwargs": refused("multimodal processor options", "no multimodal data here"),
        d + "tool_config_path": refused("tools", "agent.environment (docs/agents.md)"),
        d + "function_tool_path": refused("tools", "agent.environment (docs/agents.md)"),
        d + "gen_batch_size": refused("prompts per generation round", "dapo's rounds refill the batch"),
    }


def _trainer_keys() -> dict[str, ForeignKey]:
    t = "trainer."
    return {
        t + "balance_batch": accepted("balance tokens over ranks", MEMORY_ONLY),
        t + "total_epochs": translated(_epochs, "passes over the train files", "accepted with total_training_steps; "
                                  "else refused: write trainer.total_training_steps"),
        t + "total_training_steps": translated(unless_null("steps"), "steps", "steps"),
        t + "project_name": accepted("the tracker's project", "W&B reads WANDB_PROJECT here"),
        t + "experiment_name": accepted("the tracker's run name", "the run is named after output_dir here"),
        t + "logger": translated(_logger, "where metrics go", "logging.trackers (console: the progress bar, "
                            "logging.console_every)"),
        t + "log_val_generations": renamed("validation.samples", "validation completions kept"),
        t + "rollout_data_dir": refused("dump rollouts", "not supported (validation_samples.jsonl holds validation's)"),
        t + "validation_data_dir": accepted("dump validation generations", "validation_samples.jsonl in the run dir"),
        t + "nnodes": translated(_nodes, "nodes", "placement.num_gpus = nnodes x n_gpus_per_node"),
        t + "n_gpus_per_node": translated(_gpus, "GPUs per node", "placement.num_gpus (x nnodes)"),
        t + "save_freq": translated(_positive_or_off("checkpoint.every"), "checkpoint every N steps (-1: never)",
                               "checkpoint.every (0: never)"),
        t + "esi_redundant_time": accepted("save before an expiry", "not needed"),
        t + "resume_mode": refused("resume", "hybridflow train --resume", ("auto", "disable")),
        t + "resume_from_path": refused("resume from a checkpoint", "hybridflow train --resume"),
        t + "checkpoint_callback_class": refused("a checkpoint callback", "not supported"),
        t + "val_before_train": translated(_val_before_train, "validate before the first step", "validate_before_train "
                                      "(with data.val_files)"),
        t + "val_only": refused("validate only", "not supported"),
        t + "test_freq": translated(_positive_or_off("validation.every"), "validate every N steps (-1: never)",
                               "validation.every (0: never)"),
        t + "critic_warmup": refused("critic-only steps first", "not supported"),
        t + "default_hdfs_dir": refused("copy checkpoints to HDFS", "not supported"),
        t + "del_local_ckpt_after_load": refused("delete a checkpoint after loading", "not supported"),
        t + "default_local_dir": renamed("output_dir", "where checkpoints go (the run directory here)"),
        t + "max_actor_ckpt_to_keep": translated(unless_null("checkpoint.keep"), "actor checkpoints kept",
                                            "checkpoint.keep"),
        t + "max_critic_ckpt_to_keep": accepted("critic checkpoints kept", "a checkpoint holds every role: "
                                             "checkpoint.keep"),
        t + "ray_wait_register_center_timeout": accepted("Ray start-up deadline",
                                                         "executor.liveness.* sets the deadlines"),
        t + "device": accepted("the accelerator", "whatever the machine has"),
        t + "use_v1": accepted("verl's trainer version", "internal to verl"),
        t + "use_legacy_worker_impl": accepted("verl's worker version", "internal to verl"),
        t + "v1.trainer_mode": refused("sync or async trainer", "pipeline.mode: sync, one_step_off or async "
                                   "(docs/runtime.md)", ("sync",)),
        t + "v1.**": accepted("options of verl's async trainer modes", "read only with v1.trainer_mode (refused)"),
    }


def _other_keys() -> dict[str, ForeignKey]:
    return {
        "actor_rollout_ref.hybrid_engine": accepted("colocated actor and rollout", "the default plan colocates them"),
        "actor_rollout_ref.nccl_timeout": accepted("collective timeout", "executor.liveness.* sets the deadlines"),
        "algorithm.gamma": translated(only_for("gamma", ("ppo", "reinforce_pp")), "discount", "algorithm.options.gamma "
                                 "(ppo, reinforce_pp; verl reads it only there too)"),
        "algorithm.lam": translated(only_for("lam", ("ppo",)), "GAE lambda", "algorithm.options.lam (ppo)"),
        "algorithm.adv_estimator": translated(_estimator, "the advantage estimator", "algorithm (gae: ppo; "
                                         "reinforce_plus_plus: reinforce_pp)", first=True),
        "algorithm.norm_adv_by_std_in_grpo": translated(only_for("norm_by_std", ("grpo", "grpo_no_ref")),
                                                        "divide by the "
                                                   "group std (grpo)", "algorithm.options.norm_by_std"),
        "algorithm.filter_groups.enable": refused("dynamic sampling", "algorithm dapo (its max_rounds)"),
        "algorithm.filter_groups.**": accepted("dynamic sampling options", "read only with filter_groups.enable"),
        "algorithm.use_kl_in_reward": translated(_kl_in_reward, "KL as a reward penalty", "implied by the algorithm "
                                            "(ppo, rloo, remax, reinforce_pp)"),
        "algorithm.kl_penalty": translated(kl_estimator, "the KL estimator in the reward",
                                           "accepted at k3 (low_var_kl)"),
        "algorithm.kl_ctrl.type": translated(_kl_control, "fixed or adaptive KL", "adaptive: algorithm.options."
                                        "kl_target and kl_horizon (ppo)"),
        "algorithm.kl_ctrl.kl_coef": translated(_kl_reward_coef, "the KL reward coefficient", "algorithm.options."
                                           "kl_coef (ppo, rloo, remax, reinforce_pp)"),
        "algorithm.kl_ctrl.horizon": accepted("adaptive KL horizon", "part of kl_ctrl.type's translation"),
        "algorithm.kl_ctrl.target_kl": accepted("adaptive KL target", "part of kl_ctrl.type's translation"),
        "algorithm.use_pf_ppo": refused("preference-feedback PPO", "not built in"),
        "algorithm.pf_ppo.**": accepted("PF-PPO options", "read only with use_pf_ppo (refused)"),
        "algorithm.rollout_correction.rollout_is": refused("importance-sampling correction", "algorithm.options."
                                                       "rollout_correction: tis"),
        "algorithm.rollout_correction.**": accepted("correction options", "read only with rollout_is (refused)"),
        "custom_reward_function.path": translated(_reward("custom_reward_function."), "the reward file",
                                             "data.reward: path:name"),
        "custom_reward_function.name": accepted("the reward function's name", "part of data.reward (path:name)"),
        "custom_reward_function.reward_kwargs": refused("extra reward arguments", "not supported"),
        "reward.custom_reward_function.path": translated(_reward("reward.custom_reward_function."), "the reward file",
                                                    "data.reward: path:name"),
        "reward.custom_reward_function.name": accepted("the reward function's name", "part of data.reward"),
        "reward.num_workers": accepted("reward processes", MEMORY_ONLY),
        "reward.reward_manager.**": refused("a reward manager", "the reward functions run as data.reward says",
                                        ("register", "naive", None, "custom_reward_manager")),
        "reward.reward_model.enable": refused("a reward model", "a reward_model role with a local model (roles)"),
        "reward.reward_model.**": accepted("reward-model options", "read only with reward_model.enable (refused)"),
        "reward.sandbox_fusion.**": refused("a code sandbox", "not supported", (None, 64, 1024)),
        "reward_model.enable": refused("a reward model", "a reward_model role with a local model (roles)"),
        "reward_model.**": accepted("reward-model options", "read only with reward_model.enable (refused)"),
        "sandbox_fusion.**": refused("a code sandbox", "not supported"),
        "global_profiler.**": refused("profiler", NO_PROFILER),
        "ray_kwargs.**": refused("ray.init arguments", "ray_address; Ray's own environment variables"),
        "transfer_queue.enable": refused("verl's transfer queue", "not supported"),
        "transfer_queue.**": accepted("transfer-queue options", "read only with transfer_queue.enable (refused)"),
        "distillation.enabled": refused("distillation", "not supported"),
        "distillation.**": accepted("distillation options", "read only with distillation.enabled (refused)"),
        "skip.**": refused("replay dumped rollouts", "not supported"),
        "**._target_": accepted("Hydra's class to build", "there is no Hydra here"),
    }


VERL = Dialect(name="verl", title="verl 0.9's trainer config", match="pattern",
               rows={**worker_keys(), **_data_keys(), **_trainer_keys(), **_other_keys()})
