"""The classic, verl-tutorial style script: device meshes per role, then plan, fit and save.

Runs on a CPU machine as written: the 8 GPUs are logical (one worker per GPU id) and the models
are the built-in tiny Qwen2, SFT-warmed on the string-reversal task before RL starts.

    .venv/bin/python examples/classic_tutorial.py
"""

from hybridflow import DataParallelConfig, SingleController


def main() -> None:
    dp_config = DataParallelConfig(
        actor_model_device_mesh=[0, 1, 2, 3],
        critic_model_device_mesh=[0, 1, 2, 3],
        reward_model_device_mesh=[4, 5],
        reference_model_device_mesh=[4, 5],
        rollout_device_mesh=[6, 7],  # the actor's rollout on GPUs of its own: data_parallel_size engines
        data_parallel_size=2,
        fsdp_sharding_strategy="FULL_SHARD",
        reward_model_micro_batch_size=8,
        reward_model_max_concurrent_requests=4,
    )
    dp_config.enable_reward_cache = True
    dp_config.reward_cache_size = 10000

    controller = SingleController(
        config=dp_config, actor_model="tiny-qwen2", critic_model="tiny-qwen2", reward_model="tiny-qwen2",
        reference_model="tiny-qwen2", use_half_precision=True,
        settings={"steps": 5, "data.batch_size": 8, "output_dir": "runs/classic_tutorial",
                  "executor.name": "ray"},  # FULL_SHARD ranks are processes: Ray workers on the logical GPUs
    )
    controller.plan()
    result = controller.fit()
    print(f"metrics: {result.metrics_path}")
    print(f"saved:   {controller.save('runs/classic_tutorial_saved')}")


if __name__ == "__main__":
    main()
