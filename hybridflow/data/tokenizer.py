"""An offline character-level tokenizer built with the ``tokenizers`` library (no hub access)."""

from __future__ import annotations

import string
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + " +-*=?:,.()"


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per character of ``alphabet`` plus pad/bos/eos/unk.

    It round-trips through ``save_pretrained`` / ``AutoTokenizer.from_pretrained``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet):
        raise ValueError("char_tokenizer: alphabet has repeated characters")
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *alphabet))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>", padding_side="left")
