"""`k3jax.grammar` with the byte tokenizer: a JSON-schema constraint's packed mask allows exactly
the bytes that can continue a valid value, advances and takes tokens back, allows the end token
only once the value is complete, and then nothing but it; a bad schema is a ValueError."""
import json

import numpy as np
import pytest

pytest.importorskip("llguidance")

from k3jax.data.tokenizers import ByteTokenizer  # noqa: E402
from k3jax.grammar import Constraint, check_grammar, grammar_tokenizer, json_schema_grammar  # noqa: E402
from k3jax.sampling import unpack_bits  # noqa: E402

VOCAB = 300
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["n"],
          "additionalProperties": False}


def allowed(constraint) -> set[int]:
    return set(np.flatnonzero(unpack_bits(constraint.allowed(-(-VOCAB // 32)), VOCAB)).tolist())


def test_a_json_schema_constraint_over_bytes():
    tokenizer = ByteTokenizer()
    vocabulary = grammar_tokenizer(tokenizer, VOCAB, tokenizer.eos_id)
    constraint = Constraint(vocabulary, json_schema_grammar(SCHEMA))
    assert allowed(constraint) == {ord("{")}
    text = list(json.dumps({"n": 2}, separators=(",", ":")).encode())
    assert constraint.advance(text[:-2]) == len(text) - 2          # {"n":
    assert allowed(constraint) == {ord("1"), ord("2"), ord("3")}
    assert constraint.advance([ord("7")]) == 0                      # out of bounds: not taken
    assert constraint.advance(text[-2:]) == 2
    assert allowed(constraint) == {tokenizer.eos_id}
    constraint.rollback(2)
    assert allowed(constraint) == {ord("1"), ord("2"), ord("3")}
    assert constraint.advance(text[-2:] + [tokenizer.eos_id]) == 3
    assert allowed(constraint) == {tokenizer.eos_id}                # stopped: only the end token
    constraint.rollback(1)                                          # a speculative round takes the end back
    assert constraint.advance([tokenizer.eos_id, ord("x")]) == 1
    with pytest.raises(ValueError, match="frob"):
        check_grammar(json_schema_grammar({"type": "frob"}), vocabulary)
