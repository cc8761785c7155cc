"""Agent turns on a running vLLM engine: each turn its own vLLM request, admitted between engine steps.

A :class:`TurnLoop` is the ``generate_batch`` of the engine's ``turn_session``. It adds requests with
``LLMEngine.add_request`` and drives ``LLMEngine.step`` itself, the loop ``LLM.generate`` runs, so callers on
several threads share one running batch: a turn submitted while others decode joins them at the next step
(continuous batching across trajectories), and the scheduler's ``max_num_seqs`` (the plan's
``rollout_batch_size``) bounds the requests in flight.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

from hybridflow.backends.vllm.rollout import chosen_logprob, import_vllm, sampling_knobs

from hybridflow.agents.protocols import TurnRequest, TurnResult
from hybridflow.runtime.protocols import SamplingParams

_REQUEST_IDS = itertools.count()  # unique over every session of the process (LLM.generate numbers its own apart)


class TurnLoop:
    """Samples :class:`TurnRequest` s on ``llm`` under ``sampling``, from any number of threads at once.

    Each caller adds its requests, then steps the engine (one step at a time, under a lock) until its own are
    done; every step advances the requests of all callers. A request samples with its own ``seed`` and
    ``max_tokens`` and stops at the model's EOS (kept in its tokens: ``finished``); its log-probs are the
    engine's (``raw_logprobs``: the trainer's definition). ``version`` is the engine's weights version, stamped
    on every result. :meth:`close` aborts what is still in flight (a caller that failed mid-way).
    """

    def __init__(self, llm: Any, sampling: SamplingParams, *, eos_id: int, version: int,
                 lora_request: Any = None) -> None:
        self.llm, self.sampling, self.eos_id, self.version = llm, sampling, eos_id, version
        self.lora_request = lora_request  # the session's adapter version, fixed for all its turns
        self._lock = threading.Lock()  # vLLM's engine is not thread-safe: every call into it holds this
        # Requests wait here, not on the engine lock, so a caller is admitted at the next step of whoever steps.
        self._admit = threading.Lock()
        self._pending: list[tuple[str, TurnRequest]] = []
        self._running: set[str] = set()
        self._done: dict[str, TurnResult | Exception] = {}

    accepts_concurrent_calls = True  # callers on many threads share the engine's running batch

    def __call__(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        return self.generate_batch(requests)

    def generate_batch(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        """Each request as its own vLLM request; returns once all of them are sampled, in their order."""
        for request in requests:
            if request.max_tokens < 1:
                raise ValueError(f"TurnRequest.max_tokens={request.max_tokens} must be >= 1")
        names = [f"turn-{next(_REQUEST_IDS)}" for _ in requests]
        with self._admit:
            self._pending.extend(zip(names, requests, strict=True))
        try:
            while True:
                with self._lock:
                    self._add_pending()
                    if all(name in self._done for name in names):
                        return [_result_or_raise(self._done.pop(name)) for name in names]
                    if not self._running:
                        raise RuntimeError(f"vLLM ran out of requests before returning {len(names)} turns")
                    self._step()
        except BaseException:
            self._abort(names)
            raise

    def close(self) -> None:
        """Abort whatever is still pending or in flight (a caller that stopped waiting)."""
        with self._admit:
            names = [name for name, _ in self._pending]
        with self._lock:
            names.extend(self._running)
        self._abort(names)

    def _add_pending(self) -> None:
        with self._admit:
            pending, self._pending = self._pending, []
        vllm = import_vllm()
        final_only = vllm.sampling_params.RequestOutputKind.FINAL_ONLY  # no partial outputs: a turn is used whole
        for name, request in pending:
            params = vllm.SamplingParams(max_tokens=request.max_tokens, seed=request.seed, logprobs=0,
                                         detokenize=False, output_kind=final_only, **sampling_knobs(self.sampling))
            try:
                self.llm.llm_engine.add_request(name, vllm.TokensPrompt(prompt_token_ids=list(request.token_ids)),
                                                params, lora_request=self.lora_request)
            except Exception as err:  # e.g. a context past max_model_len: its caller raises it, the others go on
                self._done[name] = err
                continue
            self._running.add(name)

    def _step(self) -> None:
        for output in self.llm.llm_engine.step():
            if output.finished and output.request_id in self._running:
                self._running.discard(output.request_id)
                try:
                    self._done[output.request_id] = self._result(output.outputs[0])
                except Exception as err:  # every finished request gets an answer, or its caller would wait forever
                    self._done[output.request_id] = err

    def _result(self, sample: Any) -> TurnResult:
        tokens = tuple(int(token) for token in sample.token_ids)
        steps = sample.logprobs or []
        logprobs = tuple(chosen_logprob(step, token) for step, token in zip(steps, tokens, strict=True))
        return TurnResult(token_ids=tokens, logprobs=logprobs, finished=bool(tokens) and tokens[-1] == self.eos_id,
                          version=self.version)

    def _abort(self, names: Sequence[str]) -> None:
        dropped = set(names)
        with self._admit:
            self._pending = [(name, request) for name, request in self._pending if name not in dropped]
        with self._lock:
            live = [name for name in names if name in self._running]
            if live:
                self.llm.llm_engine.abort_request(live)
            self._running.difference_update(live)
            for name in names:
                self._done.pop(name, None)


def _result_or_raise(outcome: TurnResult | Exception) -> TurnResult:
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
