"""Reward cache and request limiter on their own (the controller tests cover their wiring)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hybridflow.runtime.limits import RequestLimiter, RewardCache, pair_keys


def test_pair_keys_ignore_padding_and_tell_pairs_apart():
    prompts = torch.tensor([[0, 5, 6], [5, 6, 7], [0, 5, 6]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1]])
    responses = torch.tensor([[1, 2, 9], [1, 2, 0], [1, 2, 3]])
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    keys = pair_keys(prompts, prompt_mask, responses, response_mask)
    same_as_first = pair_keys(prompts[:1], prompt_mask[:1], torch.tensor([[1, 2, 4]]), response_mask[:1])
    assert keys[0] == same_as_first[0]  # only the padding differs
    assert len(set(keys)) == 3  # other prompt, other response


def test_cache_is_lru_and_counts_hits():
    cache = RewardCache(capacity=2)
    cache.store([b"a", b"b"], [1.0, 2.0])
    assert cache.lookup([b"a"]) == [1.0]  # a is now the most recent
    cache.store([b"c"], [3.0])  # evicts b, the least recently used
    assert cache.lookup([b"a", b"b", b"c"]) == [1.0, None, 3.0]
    assert (cache.hits, cache.misses) == (3, 1)
    assert cache.hit_rate == pytest.approx(0.75)
    with pytest.raises(ValueError, match="capacity"):
        RewardCache(0)


def test_limiter_never_exceeds_its_bound_under_contention():
    limiter = RequestLimiter(3)
    inside = []

    def request() -> None:
        with limiter.slot():
            inside.append(limiter.in_flight)
            time.sleep(0.01)

    threads = [threading.Thread(target=request) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert limiter.requests == 12
    assert limiter.peak == 3  # reached, never passed
    assert max(inside) <= 3 and limiter.in_flight == 0


def _score_node():
    from hybridflow.graph import load_graph

    return load_graph("grpo").node("reward_score")


def _rows(n: int):
    from hybridflow.runtime.batch import Batch

    prompts = torch.arange(n * 3).reshape(n, 3) % 7
    return Batch.from_fields({"prompts": prompts, "prompt_mask": torch.ones(n, 3, dtype=torch.long),
                              "responses": torch.arange(n * 2).reshape(n, 2) % 5,
                              "response_mask": torch.ones(n, 2, dtype=torch.long)})


def test_serve_cuts_requests_and_keeps_at_most_k_in_flight():
    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.service import RoleServices, serve

    active, seen = [0], []
    lock = threading.Lock()

    def worker(rows: Batch):  # an instrumented stand-in for the role's workers
        with lock:
            active[0] += 1
            seen.append(active[0])
        time.sleep(0.02)
        with lock:
            active[0] -= 1
        return Batch.from_fields({"scores": rows["responses"].sum(dim=1).float()}), {}

    services = RoleServices(limiters={"reward": RequestLimiter(2)}, request_rows={"reward": 3})
    outputs, _ = serve(_score_node(), _rows(16), worker, services)
    assert len(seen) == 6  # 16 rows in requests of 3
    assert max(seen) == 2 and services.limiters["reward"].peak == 2  # the bound is reached, never passed
    assert outputs["scores"].tolist() == _rows(16)["responses"].sum(dim=1).float().tolist()  # order kept


def test_serve_skips_the_reward_model_for_cached_pairs():
    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.service import RoleServices, serve

    calls: list[int] = []

    def worker(rows: Batch):
        calls.append(len(rows))
        return Batch.from_fields({"scores": rows["responses"].sum(dim=1).float() + 0.5}), {}

    services = RoleServices(reward_cache=RewardCache(100))
    first, _ = serve(_score_node(), _rows(8), worker, services)
    second, _ = serve(_score_node(), _rows(8), worker, services)
    assert calls == [8]  # the second batch is all hits: the model is not called
    assert torch.equal(first["scores"], second["scores"])
    assert services.reward_cache is not None and services.reward_cache.hits == 8
