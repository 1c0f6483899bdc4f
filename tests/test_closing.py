"""The closer against references: llguidance (what the grammar accepts) and jsonschema (what
the schema allows). Random walks through the grammar, one random allowed token at a time, stand
in for a model that can write anything the grammar lets it."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from closing_schemas import PATTERNS, SCHEMAS
from conftest import EMBEDDED
from tailrace.engine.structured_output.closing import TokenTable
from tailrace.engine.structured_output.closing_schema import compile_schema
from tailrace.engine.structured_output.json_closing import Closer
from tailrace.engine.structured_output.regex_closing import PatternDfa, Unsupported
from tailrace.engine.structured_output.grammar import GrammarCompiler, SequenceGrammar
from tailrace.engine.structured_output.json_grammar import schema_error
from tailrace.sampling_params import SamplingParams, StructuredSpec
from tailrace.tokenizer import load_tokenizer

EOS = 2
WALKS = settings(max_examples=400, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(str(EMBEDDED), 8192, [EOS])


def grammar_for(compiler: GrammarCompiler, schema: dict) -> SequenceGrammar:
    assert schema_error(json.dumps(schema)) is None
    grammar = compiler.for_sequence(SamplingParams(structured=StructuredSpec(json.dumps(schema))))
    assert grammar.closing is not None, "the closer refused a schema the strategy means it to take"
    return grammar


def allowed_tokens(grammar: SequenceGrammar) -> list[int]:
    mask = np.frombuffer(grammar.matcher.compute_bitmask(), dtype=np.uint8)
    return [int(t) for t in np.nonzero(np.unpackbits(mask, bitorder="little"))[0] if t != EOS]


def accepts(grammar: SequenceGrammar, tokens: list[int]) -> bool:
    """Whether the grammar takes these tokens from its state and is then at a document's end."""
    matcher = grammar.matcher.deep_copy()
    return matcher.validate_tokens(tokens) == len(tokens) and (
        matcher.consume_tokens(tokens) or True) and matcher.is_accepting()


@WALKS
@given(schema=SCHEMAS, seed=st.integers(0, 2**32))
def test_every_ending_the_closer_proposes_validates_and_the_grammar_accepts_it(compiler, schema, seed):
    grammar, rng = grammar_for(compiler, schema), random.Random(seed)
    root = compile_schema(schema)
    table, closer, text = compiler.token_table(), Closer(root), b""
    for _ in range(rng.randint(0, 80)):
        # What the grammar allows and the closer follows (it refuses numbers out of range that
        # llguidance lets through, see json_closing._Number).
        tokens = [t for t in allowed_tokens(grammar) if closer.copy().feed(table.token_bytes[t])]
        if not tokens:
            break
        token = rng.choice(tokens)
        grammar.matcher.consume_token(token)
        text += table.token_bytes[token]
        assert closer.feed(table.token_bytes[token]), text
        assert len(closer.ending()) <= root.bound, text
    ending = closer.ending()
    assert ending is not None, text
    jsonschema.validate(json.loads(text + ending), schema)
    assert accepts(grammar, table.fewest(ending)), (text, ending)


@WALKS
@given(schema=SCHEMAS, seed=st.integers(0, 2**32), extra=st.integers(0, 40))
def test_a_walk_under_any_budget_from_the_minimum_ends_valid_and_within_it(compiler, schema, seed, extra):
    grammar, rng = grammar_for(compiler, schema), random.Random(seed)
    table = compiler.token_table()
    budget = grammar.closing.minimum + extra
    out: list[int] = []
    while len(out) < budget:
        tokens = allowed_tokens(grammar)
        if not tokens:
            break  # the document is whole: only eos is left
        token = grammar.choose(rng.choice(tokens), budget - len(out) - 1)
        grammar.accept(token)
        out.append(token)
    assert grammar.closing is not None  # never lost
    assert grammar.matcher.is_accepting()
    jsonschema.validate(json.loads(b"".join(table.token_bytes[t] for t in out)), schema)


def test_the_minimum_is_the_shortest_document_in_tokens(compiler):
    grammar = grammar_for(compiler, {"type": "object", "properties": {"a": {"type": "integer", "minimum": 10}},
                                     "required": ["a"]})
    table = compiler.token_table()
    assert b"".join(table.token_bytes[t] for t in grammar.closing.plan) == b'{"a": 10}'
    assert grammar.closing.minimum == len(table.fewest(b'{"a": 10}'))


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=40))
def test_fewest_spells_the_bytes_in_no_more_tokens_than_the_tokenizer(compiler, text):
    table, tokenizer = compiler.token_table(), load_tokenizer(str(EMBEDDED))
    data = text.encode()
    spelled = table.fewest(data)
    assert b"".join(table.token_bytes[t] for t in spelled) == data
    assert len(spelled) <= len(tokenizer.encode(text, add_special_tokens=False))


def test_special_tokens_never_spell_text(compiler):
    table = compiler.token_table()
    assert EOS not in table.fewest(b"<|im_end|>") and table.every_byte


@settings(max_examples=300, deadline=None)
@given(pattern=PATTERNS, walk=st.lists(st.integers(0, 10**6), max_size=12))
def test_a_pattern_ending_completes_every_prefix_to_a_full_match(pattern, walk):
    dfa, state, text = PatternDfa(pattern), 0, ""
    for pick in walk:
        moves = sorted(b for b, target in dfa.trans[state].items() if dfa.dist[target] >= 0)
        if not moves:
            break
        byte = moves[pick % len(moves)]
        state, text = dfa.step(state, byte), text + chr(byte)
    ending = dfa.ending(state).decode()
    assert re.fullmatch(pattern[1:-1], text + ending)
    assert len(ending) == dfa.dist[state]


@pytest.mark.parametrize("pattern", ["[a-z]+", "^a|b$", "^[^a]$", "^a.b$", r"^\s$"])
def test_patterns_the_closer_cannot_complete_are_refused(pattern):
    with pytest.raises(Unsupported):
        PatternDfa(pattern)


def test_a_number_the_grammar_lets_out_of_range_gives_way_to_the_ending(compiler):
    # schema_error refuses this schema before a server generates; the engine alone (LLM) does not ask it.
    schema = {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 0.25}}
    grammar = compiler.for_sequence(SamplingParams(structured=StructuredSpec(json.dumps(schema))))
    table = compiler.token_table()
    out = []
    for data in (b"[", b"0", b"]"):  # llguidance 1.9.1 would take `[0]`
        token = grammar.choose(table.ids[data], 5 - len(out) - 1)
        grammar.accept(token)
        out.append(token)
    while not grammar.matcher.is_accepting():
        token = grammar.choose(allowed_tokens(grammar)[0], 5 - len(out) - 1)
        grammar.accept(token)
        out.append(token)
    jsonschema.validate(json.loads(b"".join(table.token_bytes[t] for t in out)), schema)


def test_an_unsupported_schema_is_still_enforced_without_closing(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "date"}}}
    grammar = compiler.for_sequence(SamplingParams(structured=StructuredSpec(json.dumps(schema))))
    assert grammar.closing is None and grammar.choose(5, 0) == 5


def follow(grammar: SequenceGrammar, table: TokenTable, text: bytes, closer: Closer) -> None:
    """Feed `text` byte by byte to the grammar and the closer, both of which must take it."""
    for b in text:
        token = table.ids[bytes([b])]
        assert grammar.matcher.validate_tokens([token]) == 1, text
        grammar.matcher.consume_token(token)
        assert closer.feed(bytes([b])), text


# Numbers as llguidance writes them that a closer assuming one spelling per value could not
# follow or end: a negative zero integer, and fractions that end in 0 (the only way on from
# `255.` at a maximum of 255).
NUMBER_FORMS = [
    ({"type": "integer", "exclusiveMinimum": -43, "maximum": 50}, b"[-0"),
    ({"type": "integer", "minimum": -5, "maximum": 5}, b"[-0, -0"),
    ({"type": "number", "maximum": 255.0}, b"[255."),
    ({"type": "number", "minimum": -4.0, "exclusiveMaximum": 410.75}, b"[-4."),
    ({"type": "number", "exclusiveMinimum": 158.5, "maximum": 255.0}, b"[254.50, 160.0, 255."),
    ({"type": "number", "minimum": -1, "maximum": 1}, b"[-0."),
]


@pytest.mark.parametrize(("item", "prefix"), NUMBER_FORMS)
def test_a_number_the_grammar_writes_in_any_form_is_followed_and_ended(compiler, item, prefix):
    schema = {"type": "array", "items": item}
    grammar, table = grammar_for(compiler, schema), compiler.token_table()
    closer = Closer(compile_schema(schema))
    follow(grammar, table, prefix, closer)
    ending = closer.ending()
    assert ending is not None, prefix
    jsonschema.validate(json.loads(prefix + ending), schema)
    assert accepts(grammar, table.fewest(ending)), (prefix, ending)


def test_the_reported_schema_ends_after_a_negative_zero_id(compiler):
    schema = {"type": "object", "required": ["id", "items"], "properties": {
        "id": {"type": "array", "minItems": 1,
               "items": {"type": "integer", "exclusiveMinimum": -43, "maximum": 1203}},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["ok"], "properties": {"ok": {"type": "string", "pattern": "^(yes|no)$"}}}},
        "tags": {"type": "string"}}}
    grammar, table = grammar_for(compiler, schema), compiler.token_table()
    closer = Closer(compile_schema(schema))
    follow(grammar, table, b'{"id": [12, -0', closer)
    ending = closer.ending()
    assert ending is not None
    assert json.loads(b'{"id": [12, -0' + ending) == {"id": [12, 0], "items": [{"ok": "no"}]}
    assert accepts(grammar, table.fewest(ending))


def scripted_walk(grammar: SequenceGrammar, table: TokenTable, script: bytes, budget: int) -> bytes:
    """A model that writes `script` as far as the grammar and the budget let it: each step the
    longest allowed token that spells the script on, else the first allowed token."""
    out = b""
    for used in range(budget):
        tokens = allowed_tokens(grammar)
        if not tokens:
            break
        want = script[len(out):]
        matching = [t for t in tokens if want.startswith(table.token_bytes[t]) and table.token_bytes[t]]
        sampled = max(matching, key=lambda t: len(table.token_bytes[t])) if matching else tokens[0]
        token = grammar.choose(sampled, budget - used - 1)
        grammar.accept(token)
        out += table.token_bytes[token]
    assert grammar.closing is not None, out  # never lost
    return out


LONG_LITERALS = b'{"b": {"a": 3.0}, "id": [[2, 2]], "name": [[26007875015, 1862587, ' + b"1327215039707128300004" * 6


@pytest.mark.parametrize("numbers", [{"type": "integer"}, {"type": "number"},
                                     {"type": "integer", "exclusiveMinimum": -43},
                                     {"type": "number", "minimum": -2.5}])
def test_long_number_literals_end_valid_under_every_budget_from_the_minimum(compiler, numbers):
    schema = {"type": "object", "additionalProperties": False, "properties": {
        "b": {"type": "object", "additionalProperties": False,
              "properties": {"a": {"type": "number", "minimum": -3, "maximum": 4.5}}},
        "id": {"type": "array", "items": {"type": "array", "items": numbers}},
        "name": {"type": "array", "items": {"type": "array", "items": numbers}}}}
    table = compiler.token_table()
    minimum = grammar_for(compiler, schema).closing.minimum
    for budget in range(minimum, minimum + 160, 3):
        grammar = grammar_for(compiler, schema)
        text = scripted_walk(grammar, table, LONG_LITERALS, budget)
        assert grammar.matcher.is_accepting(), (budget, text)
        jsonschema.validate(json.loads(text), schema)
