"""The tiny agent's tokenizer continues a trajectory after a sampled turn: its plain chat template closes an
assistant turn with EOS, so an observation renders as a suffix (a tool call in a train run used to raise)."""

from __future__ import annotations

from pathlib import Path

from hybridflow.agents.chat import PLAIN_TEMPLATE, ChatRenderer
from hybridflow.models.tokenizer import PLAIN_CHAT_TEMPLATE, load_tokenizer
from hybridflow.train.config import config_from_dotted
from hybridflow.train.setup import policy_tokenizer

TOOL_RESULT = [{"role": "tool", "name": "calculator", "content": "5535"}]


def test_a_saved_tiny_agent_tokenizer_renders_observations_after_its_eos(tmp_path: Path) -> None:
    policy_tokenizer(config_from_dotted({"agent.environment": "calculator"})).save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    renderer = ChatRenderer(tokenizer, turn_end_id=tokenizer.eos_token_id)
    assert renderer.observation_ids(TOOL_RESULT) == renderer.encode("\n5535\n")


def test_chat_prompts_render_as_lines_and_assistant_turns_end_with_eos() -> None:
    tokenizer = policy_tokenizer(config_from_dotted({"agent.environment": "calculator"}))
    messages = [{"role": "user", "content": "12*3="}, {"role": "assistant", "content": "36"},
                {"role": "user", "content": "again"}]
    assert tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == "12*3=\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "12*3=\n36<eos>\nagain\n"


def test_the_renderer_fallback_is_the_tokenizer_template() -> None:
    assert PLAIN_TEMPLATE == PLAIN_CHAT_TEMPLATE
