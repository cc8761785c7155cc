"""Fixtures for the data tests."""

from __future__ import annotations

from typing import Any

import pytest
from data_files import CHAT_TEMPLATE

from hybridflow.data import char_tokenizer


@pytest.fixture
def chat_tokenizer() -> Any:
    """The offline character tokenizer with a minimal chat template (``u:hi a:`` for one user message)."""
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
