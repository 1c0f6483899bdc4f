"""Structured output within max_tokens on the embedded model at temperature 1: whatever the
schema and whatever budget from the minimum up, the answer parses and validates, and one the
budget ended says "length". Cases run as batches of one `generate` call each."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from closing_schemas import SCHEMAS
from tailrace.engine.core import BudgetTooSmall
from tailrace.engine.structured_output.json_grammar import schema_error
from tailrace.llm import LLM
from tailrace.sampling_params import SamplingParams, StructuredSpec

BATCHES = 10
BATCH = 100  # BATCHES * BATCH (schema, max_tokens) cases in all
EXTRA_TOKENS = st.one_of(st.just(0), st.integers(0, 8), st.integers(0, 80))
CASES = st.lists(st.tuples(SCHEMAS.filter(lambda s: schema_error(json.dumps(s)) is None), EXTRA_TOKENS,
                           st.integers(0, 2**31)), min_size=BATCH, max_size=BATCH)


@pytest.fixture(scope="module")
def llm(embedded_model) -> LLM:
    return LLM(embedded_model, max_num_seqs=BATCH)


@pytest.fixture(scope="module")
def prompt(llm) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": "Answer in JSON."}])


def params(schema: dict, max_tokens: int | None = None, seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed,
                          structured=StructuredSpec(json.dumps(schema)))


def minimum_tokens(llm: LLM, schema: dict) -> int:
    closing = llm.core.grammars.for_sequence(params(schema)).closing
    assert closing is not None, "the closer refused a schema the strategy means it to take"
    return closing.minimum


# A failing batch is reported whole: shrinking a hundred cases of model output would take hours.
@settings(max_examples=BATCHES, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(cases=CASES)
def test_every_answer_validates_under_any_budget_from_the_minimum(llm, prompt, cases):
    budgets = [minimum_tokens(llm, schema) + extra for schema, extra, _ in cases]
    outputs = llm.generate([prompt] * len(cases),
                           [params(schema, budget, seed) for (schema, _, seed), budget in zip(cases, budgets)])
    for (schema, _, _), budget, output in zip(cases, budgets, outputs):
        choice = output.outputs[0]
        case = f"schema {json.dumps(schema)}, max_tokens {budget}: {choice.text!r}"
        jsonschema.validate(json.loads(choice.text), schema)
        assert len(choice.token_ids) <= budget, case
        assert choice.finish_reason in ("stop", "length"), case
        assert (choice.finish_reason == "length") == (choice.token_ids[-1] not in llm.core.eos_token_ids), case


def test_json_object_answers_validate_under_any_budget(llm, prompt):
    schema = {"type": "object"}
    budgets = [minimum_tokens(llm, schema) + extra for extra in range(50)]
    outputs = llm.generate([prompt] * len(budgets), [params(schema, b, seed) for seed, b in enumerate(budgets)])
    for budget, output in zip(budgets, outputs):
        assert isinstance(json.loads(output.outputs[0].text), dict)
        assert len(output.outputs[0].token_ids) <= budget


def test_an_answer_the_budget_ended_says_length_and_validates(llm, prompt):
    schema = {"type": "object", "required": ["story"], "properties": {"story": {"type": "string"}}}
    outputs = llm.generate([prompt] * 16, [params(schema, 12, seed) for seed in range(16)])
    ended = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "length"]
    assert ended, "no answer ran into the budget"
    for choice in ended:
        assert len(choice.token_ids) == 12
        assert isinstance(json.loads(choice.text)["story"], str)


def test_a_budget_under_the_shortest_document_is_refused_before_generating(llm, prompt):
    schema = {"type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer", "minimum": 100},
                                                                        "b": {"enum": ["long value"]}}}
    minimum = minimum_tokens(llm, schema)
    with pytest.raises(BudgetTooSmall, match=f"takes {minimum} tokens, but max_tokens is {minimum - 1}; "
                                             f"set max_tokens to at least {minimum}"):
        llm.generate([prompt], params(schema, minimum - 1))
    [output] = llm.generate([prompt], params(schema, minimum))
    assert json.loads(output.outputs[0].text) == {"a": 100, "b": "long value"}


def test_the_context_left_counts_as_the_budget(embedded_model):
    small = LLM(embedded_model, max_model_len=48)
    prompt = small.tokenizer.encode("Answer in JSON, please, as the schema says.")
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"enum": ["x" * 60]}}}
    with pytest.raises(BudgetTooSmall, match="tokens are left in the context"):
        small.generate([prompt], params(schema))
    story = {"type": "object", "required": ["story"], "properties": {"story": {"type": "string"}}}
    outputs = small.generate([prompt] * 16, [params(story, 1000, seed) for seed in range(16)])
    for output in outputs:
        choice = output.outputs[0]
        assert isinstance(json.loads(choice.text)["story"], str)
        assert len(prompt) + len(choice.token_ids) <= 48
    assert any(o.outputs[0].finish_reason == "length" for o in outputs)
