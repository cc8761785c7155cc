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
