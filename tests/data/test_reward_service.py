"""Reward services over HTTP (hybridflow/data/reward_service.py), against a service on loopback started per test."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from reward_server import Answer, Service, json_answer, serve

from hybridflow.data import char_tokenizer, reward_scorer
from hybridflow.data.reward_functions import Sample
from hybridflow.data.reward_service import RewardService, RewardServiceConfig
from hybridflow.data.tasks import TASKS
from hybridflow.runtime.errors import RewardFunctionError, RewardTimeoutError

FAST = {"timeout_s": 2.0, "backoff_s": 0.01}


@pytest.fixture
def service() -> Iterator[Service]:
    with serve() as made:
        yield made


def samples(n: int) -> list[Sample]:
    return [Sample(index=i, prompt=f"p{i}", prompt_text=f"p{i}:", response=f"r{i}", ground_truth=f"g{i}")
            for i in range(n)]


def score(url: str, n: int = 3, **options: Any) -> list[float]:
    service = RewardService(url, RewardServiceConfig(**{**FAST, **options}))
    try:
        return service(samples(n))
    finally:
        service.close()


def test_batch_shape_sends_openrlhf_fields_and_reads_rewards_in_order(service: Service) -> None:
    service.answer = lambda body: json_answer({"rewards": [float(q[1]) for q in body["query"]]})
    assert score(service.url, 3) == [0.0, 1.0, 2.0]
    assert service.requests == [{"query": ["p0:r0", "p1:r1", "p2:r2"], "prompts": ["p0:", "p1:", "p2:"],
                                 "labels": ["g0", "g1", "g2"]}]


def test_batch_size_splits_requests_under_the_concurrency_cap(service: Service) -> None:
    def slow(body: Any) -> Answer:
        time.sleep(0.05)
        return json_answer({"rewards": [float(q[1]) for q in body["query"]]})

    service.answer = slow
    assert score(service.url, 7, batch_size=2, max_concurrency=2) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert sorted(len(r["query"]) for r in service.requests) == [1, 2, 2, 2]
    assert service.most_in_flight == 2


def test_extras_and_scores_are_logged_as_means_in_training_only(service: Service) -> None:
    service.answer = lambda body: json_answer({"rewards": [1.0, 0.0], "scores": [0.5, 0.5],
                                               "extra_logs": {"format_ok": [1.0, 0.0], "length": [2, 4]}})
    scorer = reward_scorer([service.url], char_tokenizer(), service=RewardServiceConfig(**FAST))
    try:
        scorer.score(samples(2), track=False)  # validation and probes: not counted
        assert scorer.drain_means() == {}
        total, parts = scorer.score(samples(2))
    finally:
        scorer.close()
    assert total == [1.0, 0.0] and parts == {service.url: [1.0, 0.0]}
    assert scorer.drain_means() == {f"reward/{service.url}/mean": 0.5, "reward/scores/mean": 0.5,
                                    "reward/format_ok/mean": 0.5, "reward/length/mean": 3.0}


def test_a_service_weighs_in_with_reward_functions(service: Service) -> None:
    def half(response: str, ground_truth: str) -> float:
        return 0.5

    service.answer = lambda body: json_answer({"rewards": [2.0] * len(body["query"])})
    scorer = reward_scorer([service.url, half], char_tokenizer(), weights=[0.25, 2.0],
                           service=RewardServiceConfig(**FAST))
    try:
        assert scorer.score(samples(2))[0] == [1.5, 1.5]
    finally:
        scorer.close()


def test_per_sample_shape_sends_slime_fields_and_reads_a_number_or_the_key(service: Service) -> None:
    service.answer = lambda body: json_answer(float(body["response"][1]))
    assert score(service.url, 3, shape="per_sample", max_concurrency=3) == [0.0, 1.0, 2.0]
    assert sorted(service.requests, key=lambda r: r["label"]) == [
        {"prompt": f"p{i}:", "response": f"r{i}", "label": f"g{i}"} for i in range(3)]
    service.answer = lambda body: json_answer({"score": 0.25, "reward": 9.0})
    assert score(service.url, 2, shape="per_sample", reward_key="score") == [0.25, 0.25]


def test_a_missing_reward_key_names_the_option(service: Service) -> None:
    service.answer = lambda body: json_answer({"score": 1.0})
    with pytest.raises(RewardFunctionError, match=r"keys \['score'\] and no 'reward'; set reward_key"):
        score(service.url, 1, shape="per_sample")


def test_429_and_5xx_are_retried_with_backoff(service: Service) -> None:
    statuses = iter([503, 429, 200])

    def flaky(body: Any) -> Answer:
        return json_answer({"rewards": [1.0] * len(body["query"])}, status=next(statuses))

    service.answer = flaky
    started = time.monotonic()
    assert score(service.url, 2, retries=2, backoff_s=0.1) == [1.0, 1.0]
    assert len(service.requests) == 3 and time.monotonic() - started >= 0.1 + 0.2  # 0.1 s, then 0.2 s


def test_a_service_that_stays_down_fails_in_one_line_naming_url_and_status(service: Service) -> None:
    service.answer = lambda body: (500, b"boom", {})
    with pytest.raises(RewardFunctionError) as caught:
        score(service.url, 2, retries=2)
    text = str(caught.value)
    assert "\n" not in text and caught.value.sample == 0 and len(service.requests) == 3
    assert text.startswith(f"reward service {service.url} failed after 3 attempts, the last with status 500 ('boom')")
    assert "raise retries" in text


def test_a_refused_connection_names_the_url_and_the_error() -> None:
    url = closed_port_url()
    with pytest.raises(RewardFunctionError, match=rf"reward service {url} failed after 2 attempts, the last with "
                                                  r"ConnectError"):
        score(url, 1, retries=1)


def test_a_client_error_is_not_retried(service: Service) -> None:
    service.answer = lambda body: (404, b"no such path", {})
    with pytest.raises(RewardFunctionError, match=r"answered status 404 \('no such path'\), which is not retried"):
        score(service.url, 1)
    assert len(service.requests) == 1


@pytest.mark.parametrize(("answer", "error"), [
    ((200, b"<html>oops</html>", {}), r"answered a body that is not JSON .*'<html>oops</html>'"),
    (json_answer({"rewards": [1.0]}), r"answered 1 rewards for 2 samples"),
    ((200, b'{"rewards": [1.0, NaN]}', {}), r"answered rewards nan for sample 1, which is not a finite float32"),
    ((200, b'{"rewards": [1e999, 1.0]}', {}), r"answered rewards inf for sample 0"),
    (json_answer({"rewards": [1.0, "0.5"]}), r"answered rewards '0.5' for sample 1, a str, not a number"),
    (json_answer({"reward": [1.0, 1.0]}), r"answered \['reward'\] without 'rewards'"),
    (json_answer({"rewards": [1.0, 1.0], "extra_logs": {"acc": [1.0]}}), r"answered 1 extra_logs\['acc'\] for 2"),
])
def test_bad_answers_are_clear_errors_and_not_retried(service: Service, answer: Answer, error: str) -> None:
    service.answer = lambda body: answer
    with pytest.raises(RewardFunctionError, match=rf"reward service {service.url} {error}"):
        score(service.url, 2)
    assert len(service.requests) == 1


def test_a_body_over_the_cap_is_refused_unread(service: Service) -> None:
    service.answer = lambda body: (200, b"{}", {"Content-Length": str(100 * 2**20)})  # claims 100 MB
    with pytest.raises(RewardFunctionError, match=r"a body of 104857600 bytes, over max_body_bytes=16777216"):
        score(service.url, 1)
    service.answer = lambda body: (200, [b"[" + b"1.0," * 100] * 5, {})  # chunked, no length: counted as read
    with pytest.raises(RewardFunctionError, match=r"a body over max_body_bytes=1000 bytes"):
        score(service.url, 1, max_body_bytes=1000)


def test_a_slow_service_times_out_naming_the_deadline(service: Service) -> None:
    def slow(body: Any) -> Answer:
        time.sleep(1.0)
        return json_answer({"rewards": [1.0]})

    service.answer = slow
    started = time.monotonic()
    with pytest.raises(RewardTimeoutError, match=r"failed after 2 attempts, the last with no answer within "
                                                  r"timeout_s=0.2 s"):
        score(service.url, 1, timeout_s=0.2, retries=1)
    assert time.monotonic() - started < 1.9  # not the two slow answers' 2 s: a hang guard, not a timing


def test_the_config_spells_service_options_as_keys(service: Service) -> None:
    from hybridflow.train import setup
    from hybridflow.train.config import load_config

    service.answer = lambda body: (502, b"", {})
    config = load_config(None, [f"data.reward={service.url}", "data.reward_service.retries=0",
                                "data.reward_service.backoff_s=0"])
    scorer = setup.reward_scorer(config, char_tokenizer())
    with pytest.raises(RewardFunctionError, match=r"status 502 .*raise data\.reward_service\.retries"):
        scorer.score(samples(1))
    scorer.close()
    with pytest.raises(ValueError, match=r"config key 'data\.reward_service\.max_concurrency'=0 must be >= 1"):
        load_config(None, ["data.reward_service.max_concurrency=0"])
    with pytest.raises(ValueError, match=r"config key 'data\.reward'='http://' is not an http:// or https:// URL"):
        setup.reward_scorer(load_config(None, ["data.reward=http://"]), char_tokenizer())


def closed_port_url() -> str:
    """A loopback URL on a port nothing listens on (bound, then closed: no one else holds it soon after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/get_reward"


@pytest.mark.slow
def test_a_training_run_is_scored_by_a_loopback_service(service: Service, tmp_path: Path) -> None:
    from hybridflow.train.config import load_config
    from hybridflow.train.loop import train

    rule = TASKS.get("reverse").reward

    def reverse_rule(body: Any) -> Answer:
        rewards = [rule(query[len(prompt):], label)
                   for query, prompt, label in zip(body["query"], body["prompts"], body["labels"], strict=True)]
        return json_answer({"rewards": rewards, "extra_logs": {"exact": [float(r == 1.0) for r in rewards]}})

    service.answer = reverse_rule
    result = train(load_config(None, [
        "steps=2", f"output_dir={tmp_path}", "data.num_examples=32", "data.batch_size=4", f"data.reward={service.url}",
        "model.sft_steps=3", "algorithm.options.n=2", "algorithm.options.max_new_tokens=4", "logging.progress=false",
        "logging.plot=false", "optim.actor.micro_batch_size=8"]))
    probe, *steps = service.requests
    assert probe["query"] == [probe["prompts"][0] + probe["labels"][0]]  # the start-up probe: row 0, answered itself
    assert len(steps) == 2 and all(len(r["query"]) == 8 for r in steps)  # 4 prompts x 2 samples, one per step
    assert all(q.startswith(p) for r in steps for q, p in zip(r["query"], r["prompts"], strict=True))
    for row, request in zip(result.history, steps, strict=True):
        expected = [rule(q[len(p):], label) for q, p, label in zip(request["query"], request["prompts"],
                                                                   request["labels"], strict=True)]
        assert row["reward/mean"] == pytest.approx(sum(expected) / len(expected))
        assert row[f"reward/{service.url}/mean"] == pytest.approx(row["reward/mean"])
        assert "reward/exact/mean" in row


QUICK = ["data.num_examples=32", "data.batch_size=4", "model.sft_steps=3", "algorithm.options.n=2",
         "algorithm.options.max_new_tokens=4", "logging.progress=false", "logging.plot=false",
         "optim.actor.micro_batch_size=8"]


def _main(capsys: pytest.CaptureFixture[str], *words: str) -> tuple[int, str]:
    from hybridflow.cli import main

    code = main(["train", *QUICK, *words])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(lines) <= 1, err
    return code, lines[0] if lines else ""


def test_a_service_down_at_the_start_is_refused_before_training(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    url = closed_port_url()
    code, line = _main(capsys, f"output_dir={tmp_path / 'run'}", f"data.reward={url}",
                       "data.reward_service.retries=1", "data.reward_service.backoff_s=0")
    assert code == 2, line
    assert re.search(rf"reward service {url} failed after 2 attempts, the last with ConnectError.*raise "
                     r"data\.reward_service\.retries.*checked before training, on row 0", line), line
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_service_down_mid_run_fails_the_step_and_resume_continues(service: Service, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    down = threading.Event()

    def answer(body: Any) -> Answer:
        if down.is_set():
            return 503, b"overloaded", {}
        if len(service.requests) == 2:  # the probe, step 0: then the service goes down
            down.set()
        return json_answer({"rewards": [0.5] * len(body["query"])})

    service.answer = answer
    run = tmp_path / "run"
    words = [f"output_dir={run}", f"data.reward={service.url}", "steps=2", "checkpoint.every=1",
             "data.reward_service.retries=1", "data.reward_service.backoff_s=0"]
    code, line = _main(capsys, *words)
    assert code == 1, line
    assert re.search(rf"reward service {service.url} failed after 2 attempts, the last with status 503 "
                     r"\('overloaded'\).*\(during step 1\)", line), line
    down.clear()
    service.answer = lambda body: json_answer({"rewards": [0.5] * len(body["query"])})
    code, line = _main(capsys, "--resume", *words)
    assert code == 0, line
    rows = [json.loads(text) for text in (run / "metrics.jsonl").read_text().splitlines() if text.strip()]
    assert [row["step"] for row in rows if "reward/mean" in row] == [0, 1]
    assert all(row["reward/mean"] == 0.5 for row in rows if "reward/mean" in row)
