"""specdec.model.loading: the tokenizer fingerprint edges and servers compare, and the embedded shapes."""

from __future__ import annotations

import pytest

from specdec.model.loading import tokenizer_fingerprint


class _Tok:
    """The parts of a tokenizer the fingerprint reads, counting how often the vocabulary is read."""

    all_special_tokens = ["<s>", "</s>"]

    def __init__(self, vocab: dict[str, int]):
        self.vocab, self.reads = dict(vocab), 0

    def get_vocab(self) -> dict[str, int]:
        self.reads += 1
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


def test_the_fingerprint_is_remembered_per_tokenizer_and_follows_added_tokens():
    tok = _Tok({"a": 0, "b": 1})
    first = tokenizer_fingerprint(tok)
    assert tokenizer_fingerprint(tok) == first and tok.reads == 1  # one read: an edge opens many sessions
    assert tokenizer_fingerprint(_Tok({"a": 0, "b": 1})) == first  # the same vocabulary, another object
    tok.vocab["c"] = 2  # a token added after the first fingerprint
    assert tokenizer_fingerprint(tok) != first and tok.reads == 2
    assert tokenizer_fingerprint(None) == "none"


@pytest.mark.slow
def test_embedded_shapes_are_the_embedded_models(embedded):
    """EMBEDDED_SHAPES (random models of the same work: benchmarks, the GPU tests) is the real config."""
    from specdec.model.loading import EMBEDDED_SHAPES

    c = embedded.model.config
    assert EMBEDDED_SHAPES == dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                                   num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                   intermediate_size=c.intermediate_size,
                                   max_position_embeddings=c.max_position_embeddings)
