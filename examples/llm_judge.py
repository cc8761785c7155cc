"""GRPO scored by an LLM judge, written as a user's graph: the built-in ``grpo_judge`` in a few lines.

    hybridflow graph examples/llm_judge.py:judged_grpo --format mermaid
    hybridflow train --config configs/grpo_judge.yaml algorithm=examples/llm_judge.py:judged_grpo
"""

from hybridflow.graph import Graph, GraphBuilder, RoleKind

SEQ = ("prompts", "responses", "response_mask")
TEMPLATE = """Task: {{ prompt }}
Reference: {{ ground_truth }}
Response: {{ response }}
Is the response correct? Reply: Verdict: correct, or Verdict: incorrect
"""


def judged_grpo(*, n: int = 4, template: str = TEMPLATE, clip_ratio: float = 0.2) -> Graph:
    g = GraphBuilder("judged_grpo")
    actor, judge = g.role("actor", RoleKind.POLICY), g.role("judge", RoleKind.FROZEN_POLICY)
    g.generate(actor, n=n, loss_mask=True)
    text = {"template": template, "verdict": "binary"}  # how this template's verdicts parse
    g.compute("judge_prompts", fn="judge_prompts", inputs=(*SEQ, "ground_truth"),
              outputs=("judge_prompts", "judge_prompts_mask"), **text)
    g.generate(judge, inputs=("judge_prompts",), outputs=("verdict_ids", "verdict_mask"), greedy=True,
               max_new_tokens=16)
    g.compute("judge", fn="judge_scores", inputs=("verdict_ids", "verdict_mask"), outputs=("scores", "verdicts"),
              **text)
    g.logprob(actor)
    g.compute("advantages", fn="grpo_advantages", inputs=("scores", "loss_mask", "uid"), outputs=("advantages",))
    g.update(actor, loss="ppo_policy", inputs=(*SEQ, "loss_mask", "old_logprobs", "advantages"),
             clip_ratio=clip_ratio)
    return g.build()
