"""A reward service of shape ``chat``: an OpenAI-compatible chat endpoint on loopback as the judge."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from reward_server import Answer, Service, json_answer, serve

from hybridflow.data import char_tokenizer
from hybridflow.data.reward_functions import Sample
from hybridflow.data.reward_service import RewardService, RewardServiceConfig
from hybridflow.runtime.errors import RewardFunctionError

SECRET = "sk-test-0123456789"


@pytest.fixture
def judge() -> Iterator[Service]:
    with serve("/v1") as made:
        yield made


def chat(content: Any) -> Answer:
    return json_answer({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})


def samples(n: int) -> list[Sample]:
    return [Sample(index=i, prompt=f"p{i}", prompt_text=f"p{i}:", response=f"r{i}", ground_truth=f"g{i}")
            for i in range(n)]


def options(**values: Any) -> RewardServiceConfig:
    return RewardServiceConfig(**{"shape": "chat", "model": "judge-1", "timeout_s": 2.0, "backoff_s": 0.01, **values})


def test_the_judge_gets_the_template_model_and_key_and_its_last_number_is_the_reward(
        judge: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    judge.answer = lambda body: chat(f"The response r{body['messages'][0]['content'][-1]} is fine. Score: 0.75")
    service = RewardService(judge.url, options(api_key_env="JUDGE_KEY", max_concurrency=2,
                                               prompt_template="Q={prompt} A={response} ref={label} @{response}"))
    try:
        assert service(samples(3)) == [0.75, 0.75, 0.75]
    finally:
        service.close()
    assert sorted(r["messages"][0]["content"] for r in judge.requests) == [
        f"Q=p{i}: A=r{i} ref=g{i} @r{i}" for i in range(3)]
    assert all(r["model"] == "judge-1" and r["messages"][0]["role"] == "user" for r in judge.requests)
    assert {h["Authorization"] for h in judge.headers} == {f"Bearer {SECRET}"}
    assert SECRET not in repr(service.options) and SECRET not in repr(service.__dict__)


def test_a_verdict_without_a_number_is_an_error_without_the_key(judge: Service,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    judge.answer = lambda body: chat("I cannot judge this.")
    service = RewardService(judge.url, options(api_key_env="JUDGE_KEY"))
    with pytest.raises(RewardFunctionError, match=r"answered a verdict with no number: 'I cannot judge this.'") as err:
        service(samples(1))
    service.close()
    assert SECRET not in str(err.value)


def test_an_answer_that_is_not_a_chat_completion_says_so(judge: Service) -> None:
    judge.answer = lambda body: json_answer({"rewards": [1.0]})
    service = RewardService(judge.url, options())
    with pytest.raises(RewardFunctionError, match=r"answered \['rewards'\] without choices\[0\]\.message\.content"):
        service(samples(1))
    service.close()
    assert judge.headers[0].get("Authorization") is None  # no api_key_env: no key sent


def test_an_unset_key_variable_is_refused_naming_it_not_a_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JUDGE_KEY_UNSET", raising=False)
    with pytest.raises(ValueError, match=r"api_key_env='JUDGE_KEY_UNSET' names an environment variable that is not "
                                         r"set"):
        RewardService("http://127.0.0.1:9/v1", options(api_key_env="JUDGE_KEY_UNSET"))


def test_the_config_refuses_a_judge_without_model_or_with_a_bad_template(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.train import setup
    from hybridflow.train.config import load_config

    with pytest.raises(ValueError, match=r"config key 'data\.reward_service\.model'=None is required with "
                                         r"data\.reward_service\.shape=chat"):
        load_config(None, ["data.reward_service.shape=chat"])
    with pytest.raises(ValueError, match=r"'data\.reward_service\.prompt_template' names \['answer'\]; a template "
                                         r"may use \['label', 'prompt', 'response'\]"):
        load_config(None, ["data.reward_service.prompt_template=Is {answer} right?"])
    monkeypatch.delenv("JUDGE_KEY_UNSET", raising=False)
    config = load_config(None, ["data.reward=http://127.0.0.1:9/v1", "data.reward_service.shape=chat",
                                "data.reward_service.model=judge", "data.reward_service.api_key_env=JUDGE_KEY_UNSET"])
    with pytest.raises(ValueError, match=r"data\.reward_service\.api_key_env='JUDGE_KEY_UNSET' names an environment"):
        setup.reward_scorer(config, char_tokenizer())
