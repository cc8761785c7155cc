"""Absurd sizes and values are refused before anything is allocated, with one line naming the field and the
fix: clusters and GPU ranges the planner would build per-GPU tables for, staleness and chunk counts beyond
what a step can run, numbers of the wrong type or out of range, mini-batches without rows, unusable models
and data. Each case must also end quickly (a hang or an out-of-memory death is the failure being tested)."""

from __future__ import annotations

import json
import resource
import shutil
import time
from pathlib import Path

import pytest

from reliability.test_bad_inputs import QUICK, _one_error_line, _run

REWARDS = '''
def huge(response, ground_truth): return 1e300
def huge_on_wrong(response, ground_truth): return 1.0 if response == ground_truth else -1e39
def big(response, ground_truth): return 3e38
'''
FILES = {
    "rewards.py": REWARDS,
    "empty_prompt.jsonl": '{"prompt": "", "ground_truth": "b"}\n',
    "blank_prompt.jsonl": '{"prompt": "a", "ground_truth": "b"}\n{"prompt": "  ", "ground_truth": "b"}\n',
    "wizard.jsonl": '{"prompt": [{"role": "wizard", "content": "hi"}], "ground_truth": "b"}\n',
    "roles_ok.jsonl": '{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], '
                      '"ground_truth": "b"}\n',
    "huge_cluster.yaml": "nodes: [{type: A100-80G, gpus: 8, count: 1000000000000}]\n",
}
SECONDS = 20.0  # each case is refused in well under this, even on a loaded 2-core machine


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, random_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("bounds")
    for name, text in FILES.items():
        (root / name).write_text(text)
    shutil.copytree(random_model_dir, root / "no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (root / "no_tokenizer" / name).unlink(missing_ok=True)
    shutil.copytree(random_model_dir, root / "not_json")
    (root / "not_json" / "config.json").write_text('{"model_type": "qwen2", "vocab_size": 4')
    shutil.copytree(random_model_dir, root / "small_vocab")
    config = json.loads((root / "small_vocab" / "config.json").read_text())
    (root / "small_vocab" / "config.json").write_text(json.dumps({**config, "vocab_size": 8}))
    return root


@pytest.fixture(autouse=True)
def bounded_memory() -> object:
    """A case that allocates per GPU or per bucket would die here instead of taking the machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = 12 << 30
    if hard != resource.RLIM_INFINITY and hard < limit:
        limit = hard
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# (id, arguments with {d} for the inputs folder, exit code, a regex the one error line must match)
TRAIN: list[tuple[str, str, int, str]] = [
    # runtime sizes
    ("staleness huge", "pipeline.mode=async pipeline.max_staleness=1000000000", 2,
     r"'pipeline\.max_staleness'=1000000000 must be <= 1024"),
    ("stream chunks huge", "pipeline.stream_chunks=1000000000", 2,
     r"'pipeline\.stream_chunks'=1000000000 must be <= 1024"),
    ("stream chunks beyond prompts", "pipeline.stream_chunks=5", 2,
     r"'pipeline\.stream_chunks'=5 exceeds the data\.batch_size=4"),
    ("num_gpus huge", "placement.num_gpus=1000000000000", 2, r"1000000000000 GPUs exceed the planner's bound"),
    ("rows of a step huge", "data.batch_size=4000000 data.num_examples=4000000 algorithm.options.n=2", 2,
     r"8000000 rows, more than \d+; lower data\.batch_size or algorithm.options\.n"),
    # size-like keys, bounded before anything is allocated (hybridflow/train/bounds.py)
    ("generated prompts beyond host memory", "data.num_examples=10000000000", 2,
     r"'data\.num_examples'=10000000000 exceeds \d+: each generated prompt holds about 1024 bytes of host memory"),
    ("sft batch huge", "model.sft_batch_size=1000000000000", 2, r"'model\.sft_batch_size'=1000000000000 exceeds"),
    ("response beyond the context", "algorithm.options.max_new_tokens=1000000", 2,
     r"'algorithm.options\.max_new_tokens'=1000000 exceeds 255: the model's context"),
    ("lora rank beyond the width", "roles.actor.lora.rank=1000000000", 2,
     r"'roles\.actor\.lora\.rank'=1000000000 exceeds 128: every weight it adapts"),
    # numbers: type, int64, finiteness, range
    ("temperature a string", "algorithm.options.temperature=hot", 2,
     r"algorithm.options\.temperature \(node 'actor_generate'\)='hot' must be a number, got str"),
    ("top_k a float", "algorithm.options.top_k=2.5", 2, r"top_k .*=2\.5 must be a int"),
    ("kl coefficient a string", "algorithm.options.kl_coef=lots", 2, r"kl_coef .*='lots' must be a number"),
    ("kl coefficient infinite", "algorithm.options.kl_coef=.inf", 2, r"kl_coef .*=inf must be a finite number"),
    ("seed beyond int64", "seed=99999999999999999999", 2, r"'seed'=99999999999999999999 does not fit a 64-bit"),
    ("steps beyond int64", "steps=-99999999999999999999", 2, r"'steps'=-99999999999999999999 does not fit"),
    ("actor lr infinite", "optim.actor.lr=.inf", 2, r"'optim\.actor\.lr'=inf must be a finite number"),
    ("critic weight decay nan", "optim.critic.weight_decay=.nan", 2, r"'optim\.critic\.weight_decay'=nan must be"),
    ("betas infinite", "optim.actor.betas=[.inf,0.9]", 2, r"'optim\.actor\.betas\[0\]'=inf must be a finite number"),
    ("reward weight nan", "data.reward=[math] data.reward_weights=[.nan]", 2,
     r"'data\.reward_weights\[0\]'=nan must be a finite number"),
    ("env reward weight infinite", "agent.env_reward_weight=-.inf", 2, r"'agent\.env_reward_weight'=-inf"),
    ("liveness timeout infinite", "executor.liveness.setup_timeout_s=.inf", 2,
     r"'executor\.liveness\.setup_timeout_s'=inf"),
    ("validation samples negative", "validation.samples=-1", 2, r"'validation\.samples'=-1 must be >= 0"),
    ("mini batches beyond rows", "optim.actor.mini_batches=1000", 2,
     r"'optim\.actor\.mini_batches'=1000 exceeds the 8 rows of a step \(data\.batch_size=4 x n=2\)"),
    ("reward an empty list", "data.reward=[]", 2, r"'data\.reward' is an empty list"),
    # counts that multiply a step's work
    ("actor epochs huge", "optim.actor.epochs=101", 2, r"'optim\.actor\.epochs'=101 exceeds 100 passes over a step"),
    ("critic epochs huge", "optim.critic.epochs=1000000000", 2, r"'optim\.critic\.epochs'=1000000000 exceeds 100"),
    ("optimizer steps per step huge", "optim.actor.epochs=100 optim.actor.mini_batches=1000", 2,
     r"'optim\.actor\.epochs'=100 x 'optim\.actor\.mini_batches'=1000 are 100000 optimizer steps per training step"),
    ("filter rounds huge", "algorithm=dapo algorithm.options.max_rounds=17", 2,
     r"max_rounds=17 must be an integer in \[0, 16\]"),
    # data: prompts and chat roles
    ("prompt empty", "data.path={d}/empty_prompt.jsonl data.reward=math data.batch_size=1", 2,
     r"empty_prompt\.jsonl line 1: the prompt is '', empty"),
    ("prompt blank", "data.path={d}/blank_prompt.jsonl data.reward=math data.batch_size=1", 2,
     r"blank_prompt\.jsonl line 2: the prompt is '  ', empty"),
    ("chat role unknown", "data.path={d}/wizard.jsonl data.reward=math data.batch_size=1", 2,
     r"wizard\.jsonl line 1: prompt message 0 has role 'wizard'; chat roles are \['system', 'user'"),
    # models: files and vocabulary
    ("model without tokenizer", "model.path={d}/no_tokenizer", 2, r"no_tokenizer' has no tokenizer files"),
    ("model config not json", "model.path={d}/not_json", 2, r"not_json/config\.json is not JSON"),
    ("tokenizer beyond vocabulary", "model.path={d}/small_vocab", 2,
     r"tokenizer produces token ids up to \d+, but .*small_vocab/config\.json has vocab_size=8"),
    # rewards outside float32, named as the reward function's
    ("reward beyond float32", "data.reward={d}/rewards.py:huge", 2,
     r"reward function '.*rewards\.py:huge' returned 1e\+300, which is beyond float32's range.*sample 0"),
    ("reward beyond float32 on wrong answers", "data.reward={d}/rewards.py:huge_on_wrong", 1,
     r"rewards\.py:huge_on_wrong' returned -1e\+39, which is beyond float32's range.*for sample \d+ \(prompt"),
    ("weighted rewards beyond float32", "data.reward=[{d}/rewards.py:big,{d}/rewards.py:big]", 2,
     r"weighted sum of reward functions .*beyond float32's range"),
]


@pytest.mark.parametrize(("arguments", "expected", "pattern"), [case[1:] for case in TRAIN],
                         ids=[case[0] for case in TRAIN])
def test_train_refuses(arguments: str, expected: int, pattern: str, inputs: Path, tmp_path: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    code, err = _run(["train", *QUICK, f"output_dir={tmp_path / 'run'}", *arguments.format(d=inputs).split()],
                     capsys)
    _one_error_line(err, code, expected, pattern)
    assert time.perf_counter() - started < SECONDS
    if expected == 2 and "data.path" not in arguments:
        assert not (tmp_path / "run" / "config.json").exists(), "config.json written by a run that failed validation"


def test_critic_mini_batches_are_bounded_by_the_rows_too() -> None:
    from hybridflow.graph import load_graph
    from hybridflow.train.config import config_from_dotted
    from hybridflow.train.preflight import check_step_rows

    config = config_from_dotted({"algorithm": "ppo", "data.batch_size": 4, "optim.critic.mini_batches": 5})
    with pytest.raises(ValueError, match=r"'optim\.critic\.mini_batches'=5 exceeds the 4 rows of a step "
                                         r"\(data\.batch_size=4 x n=1\)"):
        check_step_rows(config, load_graph("ppo"))
    check_step_rows(config_from_dotted({"algorithm": "ppo", "data.batch_size": 4, "optim.critic.mini_batches": 4}),
                    load_graph("ppo"))


def test_chat_roles_system_and_user_are_accepted(inputs: Path) -> None:
    from hybridflow.data.dataset import load_records

    records = load_records(str(inputs / "roles_ok.jsonl"))
    assert [m["role"] for m in records[0]["prompt"]] == ["system", "user"]


PLAN_BASE = ["plan", "--model", "7e9"]
PLAN: list[tuple[str, str, str]] = [
    ("cluster of 10^12 GPUs", "--cluster 1000000000000xA100-80G", r"1000000000000 GPUs exceed the planner's bound"),
    ("cluster of 10^6 machines", "--cluster 1000000x8xA100-80G", r"8000000 GPUs exceed the planner's bound"),
    ("cluster yaml of 10^12 nodes", "--cluster {d}/huge_cluster.yaml", r"count=1000000000000.*exceed the planner's"),
    ("manual range of 10^9 GPU ids", "--cluster 8xA100-80G --manual actor=0-1000000000",
     r"GPU id 1000000000 is beyond the planner's bound"),
    ("manual id of 10^18", "--cluster 8xA100-80G --manual actor=1000000000000000000",
     r"GPU id 1000000000000000000 is beyond"),
    ("stream chunks huge", "--cluster 8xA100-80G --manual actor=0-3,critic=0-3,reward=4-7,reference=4-7 "
     "--stream-chunks 1000000000", r"--stream-chunks=1000000000 must be at least 1 and at most 1024"),
    ("stream chunks beyond prompts", "--cluster 8xA100-80G --manual actor=0-3,critic=0-3,reward=4-7,reference=4-7 "
     "--batch-size 16 --stream-chunks 17", r"stream_chunks=17 exceeds the 16 prompts of a step"),
    ("staleness huge", "--cluster 8xA100-80G --pipeline async --max-staleness 1000000000",
     r"--max-staleness=1000000000 must be at least 0 and at most 1024"),
]


@pytest.mark.parametrize(("arguments", "pattern"), [case[1:] for case in PLAN], ids=[case[0] for case in PLAN])
def test_plan_refuses(arguments: str, pattern: str, inputs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    code, err = _run([*PLAN_BASE, *arguments.format(d=inputs).split()], capsys)
    _one_error_line(err, code, 2, pattern)
    assert time.perf_counter() - started < SECONDS


def test_the_largest_allowed_cluster_parses_quickly() -> None:
    from hybridflow.planner import Cluster
    from hybridflow.planner.cluster import MAX_CLUSTER_GPUS

    started = time.perf_counter()
    cluster = Cluster.parse(f"{MAX_CLUSTER_GPUS // 8}x8xH100")
    assert cluster.num_gpus == MAX_CLUSTER_GPUS and time.perf_counter() - started < SECONDS


def test_the_suite_is_large_enough() -> None:
    assert len(TRAIN) + len(PLAN) >= 25


def test_the_planner_bounds_epochs_too() -> None:
    from hybridflow.planner.settings import RunSettings

    with pytest.raises(ValueError, match=r"RunSettings\.epochs=101 exceeds 100 passes"):
        RunSettings(epochs=101)
    assert RunSettings(epochs=100).epochs == 100
