"""Token-in, token-out chat rendering: a trajectory's tokens are accumulated, never re-rendered.

Re-rendering a whole chat each turn drifts from what the model sampled: templates trim whitespace, rewrite
tool calls from parsed JSON, or merge tokens across the boundary, and the trainer then scores tokens the
policy never produced. Here the prompt is rendered once, each sampled turn is kept exactly as sampled, and
each observation is templated as a *suffix*: the tokens a chat template puts after an assistant turn's end
token and before the next assistant turn. The suffix comes from rendering a fixed two-message
conversation with and without the observation and keeping what follows its last end-of-turn token; a
template whose rendering is not prefix-stable there is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.agents.protocols import Message

_PROBE: tuple[Message, ...] = ({"role": "user", "content": "probe"}, {"role": "assistant", "content": "probe"})


class ChatRenderer:
    """Renders a prompt once and observations as token suffixes with a HF tokenizer's chat template.

    ``turn_end_id`` is the token a sampled assistant turn ends with (the model's EOS: ``<|im_end|>`` for
    Qwen2 chat models, ``<|eot_id|>`` for Llama-3): observations are continued from right after it.
    A tokenizer without a chat template renders messages as ``content`` lines (:data:`PLAIN_TEMPLATE`).
    """

    def __init__(self, tokenizer: Any, *, turn_end_id: int, tools: Sequence[Mapping[str, Any]] | None = None):
        self.tokenizer = tokenizer
        self.turn_end_id = turn_end_id
        self.tools = list(tools) if tools else None
        self._template = getattr(tokenizer, "chat_template", None) or PLAIN_TEMPLATE

    def render_text(self, messages: Sequence[Message], *, add_generation_prompt: bool,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """``messages`` through the chat template, listing ``tools`` (default: the renderer's own)."""
        text = self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else self.tools,
                                                  tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  chat_template=self._template)
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """A conversation's tokens up to and including the generation prompt of the first assistant turn;
        ``tools``: the OpenAI tool schemas this prompt lists (default: the renderer's own)."""
        return self.encode(self.render_text(messages, add_generation_prompt=True, tools=tools))

    def observation_ids(self, observation: Sequence[Message]) -> list[int]:
        """The tokens that follow a sampled turn's end token: ``observation`` templated, then the next
        assistant turn's generation prompt. Empty ``observation``: just the generation prompt."""
        base = self.encode(self.render_text(_PROBE, add_generation_prompt=False))
        full = self.encode(self.render_text([*_PROBE, *observation], add_generation_prompt=True))
        ends = [i for i, token in enumerate(base) if token == self.turn_end_id]
        if not ends:
            raise ValueError(f"the chat template never ends an assistant turn with token {self.turn_end_id} "
                             f"({self.tokenizer.convert_ids_to_tokens(self.turn_end_id)!r}, the model's EOS), so "
                             "observations cannot be appended after a sampled turn; set the model's "
                             "eos_token_id to the template's end-of-turn token")
        cut = ends[-1] + 1
        if full[:cut] != base[:cut]:
            raise ValueError("the chat template renders an assistant turn differently once messages follow it, so "
                             "a trajectory cannot be continued token for token; use a template whose past turns "
                             "render the same whatever comes after them")
        return full[cut:]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=False))


PLAIN_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}"
                  "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}")
"""For tokenizers without a chat template: each message's text on a line, an assistant turn closed by the EOS
token, no generation prompt (an observation is ``\\n<content>\\n`` after a turn's EOS). The newline is an
expression because HF renders templates with ``trim_blocks``, which drops a newline after a block tag. The tiny
agent's tokenizer carries the same text (``hybridflow.models.tokenizer.PLAIN_CHAT_TEMPLATE``)."""
