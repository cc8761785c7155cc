"""verl/TRL names: the same meaning is renamed to our key, a different one is refused saying what to write."""

from __future__ import annotations

import pytest

from hybridflow.train import setup
from hybridflow.train.config import load_config


def test_verl_and_trl_names_with_our_meaning_are_renamed() -> None:
    config = load_config(None, ["actor_rollout_ref.rollout.n=6", "data.train_batch_size=12",
                                "actor_rollout_ref.actor.optim.lr=2e-4", "max_completion_length=20"])
    assert config.algorithm.options == {"n": 6, "max_new_tokens": 20}
    assert config.data.batch_size == 12 and config.optim.actor.lr == 2e-4
    assert load_config(None, ["num_generations=3"]).algorithm.options["n"] == 3
    assert load_config(None, ["data.max_response_length=9"]).algorithm.options["max_new_tokens"] == 9
    trainer = load_config(None, ["trainer.total_training_steps=7", "trainer.save_freq=3", "trainer.test_freq=2",
                                 "actor_rollout_ref.actor.ppo_epochs=2", "save_total_limit=1"])
    assert (trainer.steps, trainer.checkpoint.every, trainer.validation.every) == (7, 3, 2)
    assert trainer.optim.actor.epochs == 2 and trainer.checkpoint.keep == 1


@pytest.mark.parametrize(("override", "advice"), [
    ("actor_rollout_ref.actor.ppo_mini_batch_size=4",
     r"optim.actor.mini_batches = data.batch_size / ppo_mini_batch_size"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=3 data.train_batch_size=8", r"a multiple of it"),
    ("loss_type=bnpo", r"nearest is loss_type 'dapo'"),
])
def test_names_with_another_meaning_are_refused_with_the_fix(override: str, advice: str) -> None:
    with pytest.raises(KeyError, match=advice):
        load_config(None, override.split())


def test_names_that_mean_ours_are_renamed_and_two_of_them_must_agree() -> None:
    config = load_config(None, ["beta=0.04", "data.train_files=x.parquet"])
    assert config.algorithm.options == {"kl_coef": 0.04} and config.data.path == "x.parquet"
    with pytest.raises(KeyError, match=r"both set 'algorithm.options.kl_coef' \(0.04 vs 0.01\)"):
        load_config(None, ["beta=0.04", "actor_rollout_ref.actor.kl_loss_coef=0.01"])
    with pytest.raises(KeyError, match=r"'rloo' has no KL loss term"):
        load_config(None, ["algorithm=rloo", "beta=0.04"])


def test_both_spellings_of_one_setting_are_refused() -> None:
    with pytest.raises(KeyError, match=r"same setting; keep 'algorithm.options.n'"):
        load_config(None, ["algorithm.options.n=2", "rollout.n=4"])


def test_an_option_the_algorithm_does_not_take_is_named_not_a_type_error() -> None:
    config = load_config(None, ["algorithm.options.kl_loss_coef=0.1"])
    with pytest.raises(KeyError, match=r"'algorithm.options.kl_loss_coef'.*\(verl: .*its options are"):
        setup.build_graph(config)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "rloo", "remax", "reinforce_pp", "dapo", "gspo", "dr_grpo"])
def test_top_p_and_top_k_reach_the_generate_node_and_defaults_leave_the_graph_as_it_was(algorithm: str) -> None:
    from hybridflow.graph import Op, load_graph

    def sampling(**options: object) -> dict[str, object]:
        graph = load_graph(algorithm, reward_kind="reward_function", **options)
        node = next(n for n in graph.nodes if n.op is Op.GENERATE)
        return dict(node.options)

    assert {"top_p", "top_k"}.isdisjoint(sampling())
    assert sampling(top_p=0.9, top_k=20)["top_p"] == 0.9 and sampling(top_k=20)["top_k"] == 20


def test_verl_and_trl_sampling_names_reach_the_graph() -> None:
    config = load_config(None, ["actor_rollout_ref.rollout.top_p=0.8", "actor_rollout_ref.rollout.top_k=5"])
    assert config.algorithm.options == {"top_p": 0.8, "top_k": 5}
    assert load_config(None, ["top_p=0.7"]).algorithm.options == {"top_p": 0.7}
    with pytest.raises(ValueError, match=r"top_p=1.5 must be in \(0, 1\]"):
        setup.build_graph(load_config(None, ["algorithm.options.top_p=1.5"]))
