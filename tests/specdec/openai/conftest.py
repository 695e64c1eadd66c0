"""The target's tokenizer for the OpenAI wire-format tests (the embedded model's)."""

import pytest


@pytest.fixture(scope="module")
def tok():
    from specdec.model.loading import load_tokenizer

    return load_tokenizer("embedded")
