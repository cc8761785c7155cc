"""A model's tokenizer: the offline character-level one of the tiny models, built with the ``tokenizers`` library
(no hub access), and the loader of a tokenizer saved beside a model. Data, runtime and backends all read it here."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + " +-*=?:,.()"
# For prompts from files (word problems, chat turns): every printable ASCII character and a newline.
WIDE_ALPHABET = DEFAULT_ALPHABET + "".join(sorted(set(string.printable) - set(DEFAULT_ALPHABET) - set("\t\r\x0b\x0c")))
# A template with no role markers, so a character tokenizer can render chat prompts: each turn's text on a line,
# an assistant turn closed by the EOS token so that a multi-turn rollout can continue after a sampled turn (the
# same text as hybridflow.agents.chat.PLAIN_TEMPLATE). The newline is an expression: HF renders templates with
# trim_blocks, which would drop a literal newline after a block tag.
PLAIN_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}"
                       "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}")


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET, *, chat_template: str | None = None) -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per character of ``alphabet`` plus pad/bos/eos/unk.

    It round-trips through ``save_pretrained`` / ``AutoTokenizer.from_pretrained``; ``chat_template``
    (e.g. :data:`PLAIN_CHAT_TEMPLATE`) lets it render chat-message prompts.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet):
        raise ValueError("char_tokenizer: alphabet has repeated characters")
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *alphabet))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>", unk_token="<unk>", padding_side="left")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in ``path``.

    ``AutoTokenizer`` picks the tokenizer class from the *model* type (a Qwen2 tokenizer for a tiny
    Qwen2), which would mangle our character tokenizer (it drops spaces); a tokenizer saved as a plain
    ``tokenizers`` backend is therefore loaded as such.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
