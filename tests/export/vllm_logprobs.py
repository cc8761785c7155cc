"""Log-probs of given response tokens under vLLM (``python vllm_logprobs.py MODEL_DIR ROWS_JSON OUT_JSON``).

A script, not a test: vLLM starts an engine process and needs the ``__main__`` guard.
"""

from __future__ import annotations

import json
import os
import sys


def main(model: str, rows_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default would claim a quarter of RAM on CPU
    from vllm import LLM, SamplingParams

    with open(rows_path) as handle:
        rows = json.load(handle)  # [{"prompt": [ids], "response": [ids]}, ...]
    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, max_model_len=256)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outputs = llm.generate([{"prompt_token_ids": r["prompt"] + r["response"]} for r in rows], params)
    found = []
    for row, output in zip(rows, outputs, strict=True):
        ids = row["prompt"] + row["response"]
        per_token = output.prompt_logprobs  # position i: {token id: Logprob} for ids[i] (None at 0)
        found.append([per_token[i][ids[i]].logprob for i in range(len(row["prompt"]), len(ids))])
    with open(out_path, "w") as handle:
        json.dump(found, handle)


if __name__ == "__main__":
    main(*sys.argv[1:4])
