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

    def __init__(self, llm: Any, sampling: SamplingParams, *, eos_id: int, version: int) -> None:
        self.llm, self.sampling, self.eos_id, self.version = llm, sampling, eos_id, version
        self._lock = threading.Lock()  # vLLM's engine is not thread-safe: every call into it holds this
        self._running: set[str] = set()
        self._done: dict[str, TurnResult] = {}

    def generate_batch(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        """Each request as its own vLLM request; returns once all of them are sampled, in their order."""
        ids: list[str] = []
        try:
            with self._lock:
                for request in requests:
                    ids.append(self._add(request))
            while True:
                with self._lock:
                    if all(name in self._done for name in ids):
                        return [self._done.pop(name) for name in ids]
                    self._step()
        except BaseException:
            self._abort(ids)
            raise

    def close(self) -> None:
        self._abort(list(self._running))

    def _add(self, request: TurnRequest) -> str:
        vllm = import_vllm()
        if request.max_tokens < 1:
            raise ValueError(f"TurnRequest.max_tokens={request.max_tokens} must be >= 1")
        params = vllm.SamplingParams(max_tokens=request.max_tokens, seed=request.seed, logprobs=0, detokenize=False,
                                     output_kind=vllm.sampling_params.RequestOutputKind.FINAL_ONLY,
                                     **sampling_knobs(self.sampling))
        name = f"turn-{next(_REQUEST_IDS)}"
        self.llm.llm_engine.add_request(name, vllm.TokensPrompt(prompt_token_ids=list(request.token_ids)), params)
        self._running.add(name)
        return name

    def _step(self) -> None:
        for output in self.llm.llm_engine.step():
            if output.finished and output.request_id in self._running:
                self._running.discard(output.request_id)
                self._done[output.request_id] = self._result(output.outputs[0])

    def _result(self, sample: Any) -> TurnResult:
        tokens = tuple(int(token) for token in sample.token_ids)
        steps = sample.logprobs or []
        logprobs = tuple(chosen_logprob(step, token) for step, token in zip(steps, tokens, strict=True))
        return TurnResult(token_ids=tokens, logprobs=logprobs, finished=bool(tokens) and tokens[-1] == self.eos_id,
                          version=self.version)

    def _abort(self, ids: Sequence[str]) -> None:
        with self._lock:
            live = [name for name in ids if name in self._running]
            if live:
                self.llm.llm_engine.abort_request(live)
            self._running.difference_update(live)
            for name in ids:
                self._done.pop(name, None)

