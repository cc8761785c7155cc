"""Prompt records: plain-text or chat-message prompts, and the ground truth a reward function receives.

A record is a dict with a ``prompt`` (a string, or chat messages ``[{"role", "content"}, ...]``), a
``ground_truth`` string and, optionally, the row's other columns (verl's ``data_source`` and
``extra_info``, or any column a TRL-style reward function asks for by name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Record = dict[str, Any]
Messages = list[dict[str, str]]

# Keys of a record that are not "other columns" passed on to reward functions. ``raw_prompt`` keeps a
# chat prompt's messages once ``prompt`` holds its rendered text (verl's name for the same thing).
# ``images``: a vision row's images (hybridflow.data.images), model inputs rather than a column for reward functions.
PROMPT, GROUND_TRUTH, RAW_PROMPT, IMAGES = "prompt", "ground_truth", "raw_prompt", "images"
RESERVED = (PROMPT, GROUND_TRUTH, RAW_PROMPT, IMAGES)
CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates (HF, OpenAI) render


class GroundTruth(str):
    """A ground-truth string that also carries its row's ``data_source``, ``extra_info`` and other columns.

    The runtime hands a score node only its ports (``prompts``, ``responses``, ``response_mask``,
    ``ground_truth``), so the rest of the row travels inside the ground truth: a two-argument rule
    still gets a plain-behaving ``str``, while a reward function that asks for ``data_source``,
    ``extra_info`` or a column by name gets it. It pickles (Ray) and sits in numpy object arrays.
    """

    data_source: str | None
    extra_info: dict[str, Any] | None
    columns: dict[str, Any]
    prompt: str | Messages | None

    def __new__(cls, value: str, *, data_source: str | None = None, extra_info: Mapping[str, Any] | None = None,
                columns: Mapping[str, Any] | None = None, prompt: str | Messages | None = None) -> GroundTruth:
        made = super().__new__(cls, value)
        made.data_source = data_source
        made.extra_info = dict(extra_info) if extra_info is not None else None
        made.columns = dict(columns or {})
        made.prompt = prompt
        return made


def reward_target(record: Mapping[str, Any]) -> str:
    """The ground truth a scorer sees for ``record``: a plain ``str``, or a :class:`GroundTruth` with context."""
    truth = str(record[GROUND_TRUTH])
    extras = {key: value for key, value in record.items() if key not in RESERVED}
    prompt = record.get(RAW_PROMPT, record.get(PROMPT))
    if not extras and not is_chat(prompt):
        return truth
    source = extras.get("data_source")
    info = extras.get("extra_info")
    return GroundTruth(truth, data_source=None if source is None else str(source),
                       extra_info=info if isinstance(info, Mapping) else None, columns=extras,
                       prompt=prompt if isinstance(prompt, str | list) else None)


def is_chat(prompt: object) -> bool:
    """True for a list of chat messages (verl's and TRL's conversational prompt format)."""
    return isinstance(prompt, list) and all(isinstance(m, Mapping) for m in prompt)


def check_prompt(prompt: object, where: str) -> str | Messages:
    """``prompt`` as a string or validated chat messages; anything else is an error naming ``where``."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: the prompt is {prompt!r}, empty; the policy would generate from nothing. "
                             "Drop the row or give it a prompt")
        return prompt
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | str):
        messages = list(prompt)
        for i, message in enumerate(messages):
            if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"{where}: prompt message {i} is {message!r}; chat prompts must be a list of "
                                 '{"role": str, "content": str} messages')
            if message["role"] not in CHAT_ROLES:
                raise ValueError(f"{where}: prompt message {i} has role {message['role']!r}; chat roles are "
                                 f"{list(CHAT_ROLES)} (chat templates render no other)")
        if not messages:
            raise ValueError(f"{where}: the prompt is an empty list of chat messages")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    raise ValueError(f"{where}: the prompt is a {type(prompt).__name__} ({prompt!r}); use a string or a list of "
                     '{"role", "content"} chat messages')


def render_prompt(prompt: str | Messages, tokenizer: Any, where: str = "prompt",
                  tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The text the policy sees: a string as is, chat messages through the tokenizer's chat template.

    The template is applied with ``add_generation_prompt=True`` (what verl and TRL do), so the model
    continues as the assistant; ``tools`` (OpenAI function schemas) are rendered where the template lists them.
    """
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: the prompt is a list of chat messages, but the tokenizer "
                         f"({type(tokenizer).__name__}) has no chat template; use a model whose tokenizer has one "
                         "(tokenizer_config.json 'chat_template'), set tokenizer.chat_template, or give plain-text "
                         "prompts")
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                         **({"tools": list(tools)} if tools else {}))
    if not isinstance(text, str):
        raise TypeError(f"{where}: apply_chat_template returned {type(text).__name__}, not the prompt text")
    return text
