"""Token ids in, token ids and log-probs out, over an OpenAI-compatible ``/v1/completions`` endpoint.

The prompt travels as a list of token ids (OpenAI's completions API takes one) and the sampled tokens come
back as ids (vLLM's ``return_token_ids`` extension) with each one's log-prob (``logprobs: 0``: the sampled
token's alone), so nothing is re-tokenised on the way and the tokens trained on are the tokens sampled. A
request may carry a session key (header ``X-Session-ID``), which the router hashes to pick a replica: the
samples of one prompt, or the turns of one trajectory, land where their prefix is cached.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

SESSION_HEADER = "X-Session-ID"


class ServerRequestError(RuntimeError):
    """A server refused a request or failed it (status and the server's own message)."""


@dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    """One prompt's request: its token ids, budget, sampling knobs (``temperature``, ``top_p``, ``top_k``), seed."""

    prompt: Sequence[int]
    max_tokens: int
    seed: int
    sampling: Mapping[str, Any] = field(default_factory=dict)
    logprobs: bool = True
    session: str | None = None


@dataclass(frozen=True)
class Completion:
    """The sampled ``token_ids``, each one's ``logprobs`` (empty when not asked) and why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


class CompletionsClient:
    """Sends :class:`CompletionRequest` s to ``base_url`` (a router or one replica), ``concurrency`` at a time."""

    def __init__(self, base_url: str, model: str, *, timeout_s: float = 600.0, concurrency: int = 64,
                 retries: int = 6, retry_wait_s: float = 0.5, retry_deadline_s: float = 120.0) -> None:
        self.base_url, self.model = base_url.rstrip("/"), model
        self.retries, self.retry_wait_s, self.retry_deadline_s = retries, retry_wait_s, retry_deadline_s
        self.retried = 0  # requests sent again after a 5xx or a lost connection (a replica lost mid-request)
        self._count = threading.Lock()
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        # trust_env=False: a proxy from the environment must not carry loopback traffic elsewhere.
        self._http = httpx.Client(timeout=timeout_s, limits=limits, trust_env=False)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="completions")

    def body(self, request: CompletionRequest) -> dict[str, Any]:
        """The JSON body of ``request``; stop rules stated explicitly (the router fills unset ones with its own)."""
        body: dict[str, Any] = {"model": self.model, "prompt": [int(t) for t in request.prompt],
                                "max_tokens": request.max_tokens, "seed": request.seed, "return_token_ids": True,
                                "ignore_eos": False, "echo": False, "stream": False, **request.sampling}
        if request.logprobs:
            body["logprobs"] = 0  # the sampled token's own log-prob, no alternatives
        return body

    def complete(self, request: CompletionRequest) -> Completion:
        """One request; a 5xx reply or a lost connection (the router's replica died under it) is sent again, up to
        ``retries`` times ``retry_wait_s`` apart, by then the router has re-routed its session, and none is sent
        once ``retry_deadline_s`` has passed since the first (the fleet's router does not retry itself). A 4xx is
        not sent again."""
        headers = {SESSION_HEADER: request.session} if request.session else {}
        url = f"{self.base_url}/v1/completions"
        failure, started = "", time.monotonic()
        for attempt in range(self.retries + 1):
            if attempt and time.monotonic() - started + self.retry_wait_s > self.retry_deadline_s:
                raise ServerRequestError(f"{failure} (after {attempt - 1} retries; the retry deadline "
                                         f"{self.retry_deadline_s:.0f} s passed)")
            if attempt:
                with self._count:
                    self.retried += 1
                time.sleep(self.retry_wait_s)
            try:
                reply = self._http.post(url, json=self.body(request), headers=headers)
            except httpx.TransportError as err:
                failure = f"POST {url} failed: {type(err).__name__}: {err}"
                continue
            if reply.status_code == 200:
                return parse_completion(reply.json(), want_logprobs=request.logprobs)
            failure = f"POST {url} -> {reply.status_code}: {_message(reply)}"
            if reply.status_code < 500:
                raise ServerRequestError(failure)
        raise ServerRequestError(f"{failure} (after {self.retries} retries)")

    def complete_all(self, requests: Sequence[CompletionRequest]) -> list[Completion]:
        """Every request, concurrently; results in request order (the first failure is raised)."""
        return list(self._pool.map(self.complete, requests))

    def complete_each(self, requests: Sequence[CompletionRequest]) -> list[Completion | ServerRequestError]:
        """Every request, concurrently, in request order: each one's completion or its failure (to send those again)."""
        def attempt(request: CompletionRequest) -> Completion | ServerRequestError:
            try:
                return self.complete(request)
            except ServerRequestError as failure:
                return failure
        return list(self._pool.map(attempt, requests))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()


def parse_completion(payload: Mapping[str, Any], *, want_logprobs: bool) -> Completion:
    """The first choice of a completions reply; refuses one without token ids (a server lacking the extension)."""
    choice = payload["choices"][0]
    tokens = choice.get("token_ids")
    if tokens is None:
        raise ServerRequestError("the server returned no token_ids: it must support vLLM's return_token_ids "
                                 "(vLLM >= 0.10); text would have to be re-tokenised, which the trainer refuses")
    logprobs: list[float] = []
    if want_logprobs:
        given = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(given) != len(tokens):
            raise ServerRequestError(f"the server returned {len(given)} log-probs for {len(tokens)} tokens")
        logprobs = [float(value) for value in given]
    return Completion(token_ids=[int(t) for t in tokens], logprobs=logprobs, finish_reason=choice.get("finish_reason"))


def _message(reply: httpx.Response) -> str:
    """The server's error message on one line (vLLM: ``{"error": {"message": ...}}``; FastAPI: ``{"detail": ...}``)."""
    try:
        payload = reply.json()
    except ValueError:
        return reply.text.strip().replace("\n", " ")[:500]
    if isinstance(payload, dict):
        error = payload.get("error")
        found = error.get("message") if isinstance(error, dict) else error or payload.get("detail") or payload
        return str(found).replace("\n", " ")[:500]
    return str(payload)[:500]
