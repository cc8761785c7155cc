"""Per-role service limits: a reward cache and a bound on in-flight requests.

Both sit between the controller and a role's workers. The cache lets repeated (prompt, response)
pairs skip the reward model; the limiter caps how many requests a role's workers hold at once, so
a slow inference group queues work in the controller instead of being flooded.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


def pair_keys(prompts: torch.Tensor, prompt_mask: torch.Tensor | None, responses: torch.Tensor,
              response_mask: torch.Tensor) -> list[bytes]:
    """A digest per row of the real (unpadded) prompt and response tokens. (B, P), (B, P), (B, T), (B, T)."""
    keys = []
    for row in range(len(responses)):
        prompt = prompts[row] if prompt_mask is None else prompts[row][prompt_mask[row].bool()]
        response = responses[row][response_mask[row].bool()]
        digest = hashlib.blake2b(digest_size=16)
        digest.update(prompt.to(torch.int64).numpy().tobytes())
        digest.update(b"|")
        digest.update(response.to(torch.int64).numpy().tobytes())
        keys.append(digest.digest())
    return keys


class RewardCache:
    """An LRU of sequence scores keyed by a hash of prompt + response; counts hits and misses."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"reward cache capacity={capacity} must be >= 1")
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._scores: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._scores)

    def lookup(self, keys: Sequence[bytes]) -> list[float | None]:
        """The cached score of each key (None on a miss); hits become most recently used."""
        with self._lock:
            found: list[float | None] = []
            for key in keys:
                score = self._scores.get(key)
                if score is None:
                    self.misses += 1
                else:
                    self._scores.move_to_end(key)
                    self.hits += 1
                found.append(score)
            return found

    def store(self, keys: Sequence[bytes], scores: Sequence[float]) -> None:
        with self._lock:
            for key, score in zip(keys, scores, strict=True):
                self._scores[key] = float(score)
                self._scores.move_to_end(key)
            while len(self._scores) > self.capacity:
                self._scores.popitem(last=False)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class RequestLimiter:
    """A semaphore over a role's in-flight requests that also records the most it ever saw at once."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrent_requests={limit} must be >= 1")
        self.limit = limit
        self.in_flight = 0
        self.peak = 0
        self.requests = 0
        self._slots = threading.Semaphore(limit)
        self._lock = threading.Lock()

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one of the ``limit`` slots for the duration of a request."""
        with self._slots:
            with self._lock:
                self.in_flight += 1
                self.requests += 1
                self.peak = max(self.peak, self.in_flight)
            try:
                yield
            finally:
                with self._lock:
                    self.in_flight -= 1
