"""The request schema: OpenAI fields and vLLM extensions, null as absent, ranges, sampling mapping."""

import pytest
from pydantic import ValidationError

from tailrace.serving.errors import OpenAIError
from tailrace.serving.protocol import (
    ChatCompletionRequest, CompletionRequest, TokenizeRequest, unknown_fields, unsupported_fields,
)


def completion(**fields):
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields):
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def error_of(build, **fields) -> dict:
    with pytest.raises(ValidationError) as caught:
        build(**fields)
    return caught.value.errors()[0]


# ---- parsing ----

@pytest.mark.parametrize(("build", "field", "value"), [
    (chat, "stream", "yes"), (completion, "stream", 1), (chat, "logprobs", "true"), (completion, "n", "2"),
    (chat, "n", 2.0), (completion, "max_tokens", True), (chat, "temperature", "0.5"), (completion, "echo", "false"),
])
def test_json_types_are_strict(build, field, value):
    assert error_of(build, **{field: value})["type"].endswith("_type")


def test_an_integer_is_a_number():
    assert (chat(temperature=1).temperature, completion(top_p=0).top_p) == (1.0, 0.0)


def test_logit_bias_keys_are_token_ids_written_as_strings():
    assert chat(logit_bias={"50": -100}).logit_bias == {50: -100.0}


def test_unknown_top_level_fields_are_named():
    body = {"model": "m", "prompt": "hi", "best_of": 1, "frobnicate": 1, "zeta": None}
    assert unknown_fields(CompletionRequest, body) == ["frobnicate", "zeta"]


def test_an_alias_is_a_known_field():
    assert unknown_fields(ChatCompletionRequest, {"model": "m", "messages": [], "max_completion_tokens": 1}) == []

@pytest.mark.parametrize("prompt", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_prompt_accepts_every_openai_shape(prompt):
    assert completion(prompt=prompt).prompt == prompt


@pytest.mark.parametrize("prompt", [[], [[]], [-1]])
def test_prompt_rejects_empty_token_lists_and_negative_ids(prompt):
    with pytest.raises(ValidationError):
        completion(prompt=prompt)


def test_null_fields_take_their_defaults():
    request = completion(logprobs=None, seed=None, n=None, temperature=None, stream=None, echo=None)
    assert (request.logprobs, request.seed, request.n, request.temperature, request.stream, request.echo) == (
        None, None, 1, 1.0, False, False)


def test_unknown_keys_are_ignored():
    assert not hasattr(completion(brand_new_field=3), "brand_new_field")


def test_developer_role_is_accepted():
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "x"}]})
    assert request.messages[0].role == "developer"


def test_assistant_tool_call_replay_with_null_content_and_index_parses():
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]})
    assert request.messages[1].tool_calls[0].function.name == "w"


def test_tool_message_without_tool_call_id_is_missing_a_parameter():
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "tool", "content": "x"}]})
    assert caught.value.errors()[0]["type"] == "missing_required_parameter"


def test_user_message_without_content_is_missing_a_parameter():
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user"}]})
    assert caught.value.errors()[0]["ctx"]["field"] == "content"


def test_message_text_joins_text_parts():
    request = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                         {"type": "text", "text": "b"}]}])
    assert request.messages[0].text() == "ab"


def test_template_dict_drops_absent_fields_and_joins_content():
    request = chat(messages=[{"role": "user", "name": None, "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}])
    assert request.messages[0].template_dict() == {"role": "user", "content": "ab"}


def test_stream_options_accepts_include_obfuscation_and_continuous_usage():
    request = chat(stream=True, stream_options={"include_usage": True, "include_obfuscation": False,
                                                "continuous_usage_stats": True})
    assert request.include_usage and request.continuous_usage_stats


# ---- ranges ----

@pytest.mark.parametrize("field,value", [
    ("temperature", 2.01), ("temperature", -0.1), ("top_p", 1.5), ("n", 0), ("n", 129),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("max_tokens", -1), ("logprobs", 6),
    ("best_of", 21), ("min_p", 1.5), ("top_k", -2), ("repetition_penalty", 0.0),
])
def test_completion_field_out_of_range_is_rejected_at_that_field(field, value):
    assert error_of(completion, **{field: value})["loc"][0] == field


def test_chat_top_logprobs_above_20_is_rejected():
    assert error_of(chat, logprobs=True, top_logprobs=21)["loc"] == ("top_logprobs",)


def test_chat_top_logprobs_without_logprobs_is_rejected():
    assert error_of(chat, top_logprobs=2)["ctx"]["param"] == "top_logprobs"


def test_logit_bias_value_over_100_is_rejected():
    assert error_of(completion, logit_bias={"5": 101})["loc"][0] == "logit_bias"


def test_logit_bias_key_must_be_a_token_id():
    assert error_of(completion, logit_bias={"abc": 1})["loc"][0] == "logit_bias"


def test_best_of_below_n_is_rejected():
    assert error_of(completion, n=3, best_of=2)["ctx"]["param"] == "best_of"


def test_min_tokens_over_max_tokens_is_rejected():
    assert error_of(completion, max_tokens=2, min_tokens=3)["ctx"]["param"] == "min_tokens"


def test_continue_final_message_turns_off_the_default_generation_prompt():
    assert chat(continue_final_message=True).add_generation_prompt is False


def test_continue_final_message_with_explicit_generation_prompt_is_rejected():
    error = error_of(chat, continue_final_message=True, add_generation_prompt=True)
    assert error["ctx"]["param"] == "continue_final_message"


# ---- sampling params ----

def test_completion_max_tokens_defaults_to_16():
    assert completion().to_sampling_params().max_tokens == 16


def test_chat_max_tokens_defaults_to_none():
    assert chat().to_sampling_params().max_tokens is None


def test_chat_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=7).to_sampling_params().max_tokens == 7


def test_chat_max_tokens_alone_is_honoured():
    assert chat(max_tokens=5).to_sampling_params().max_tokens == 5


def test_completion_logprobs_map_to_sampling_logprobs_without_prompt_logprobs():
    params = completion(logprobs=3).to_sampling_params()
    assert (params.logprobs, params.prompt_logprobs) == (3, None)


def test_completion_echo_with_logprobs_asks_for_prompt_logprobs():
    params = completion(logprobs=2, echo=True).to_sampling_params()
    assert (params.logprobs, params.prompt_logprobs) == (2, 2)


def test_chat_logprobs_true_without_top_logprobs_is_zero_alternatives():
    assert chat(logprobs=True).to_sampling_params().logprobs == 0


def test_chat_top_logprobs_map_to_sampling_logprobs():
    assert chat(logprobs=True, top_logprobs=5).to_sampling_params().logprobs == 5


def test_chat_without_logprobs_asks_for_none():
    assert chat().to_sampling_params().logprobs is None


def test_string_stop_becomes_a_list():
    assert completion(stop="\n").to_sampling_params().stop == ["\n"]


def test_vllm_extensions_reach_sampling_params():
    params = completion(top_k=5, min_p=0.1, repetition_penalty=1.2, min_tokens=1, ignore_eos=True,
                        stop_token_ids=[7], include_stop_str_in_output=True, skip_special_tokens=False,
                        seed=11, logit_bias={"3": -100}).to_sampling_params()
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens, params.ignore_eos,
            params.stop_token_ids, params.include_stop_str_in_output, params.skip_special_tokens,
            params.seed, params.logit_bias) == (5, 0.1, 1.2, 1, True, [7], True, False, 11, {3: -100.0})


def test_top_p_zero_is_accepted_and_keeps_the_sampler_valid():
    assert 0 < completion(top_p=0).to_sampling_params().top_p <= 1e-6


def test_sampling_error_becomes_an_openai_400_naming_the_param():
    with pytest.raises(OpenAIError) as caught:
        completion(min_tokens=20).to_sampling_params()  # over the default max_tokens of 16
    assert (caught.value.status, caught.value.param) == (400, "min_tokens")


# ---- unsupported fields ----

@pytest.mark.parametrize("fields,expected", [
    ({"suffix": "end"}, "suffix"), ({"best_of": 2}, "best_of"),
])
def test_completion_unsupported_fields_are_named(fields, expected):
    assert unsupported_fields(completion(**fields)) == expected


def test_completion_best_of_equal_to_n_is_supported():
    assert unsupported_fields(completion(n=2, best_of=2)) is None


def test_completion_n_above_one_with_stream_is_supported():
    assert unsupported_fields(completion(n=2, stream=True)) is None


@pytest.mark.parametrize("fields,expected", [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"tools": [{"type": "custom", "custom": {"name": "c"}}]}, "tools[0].custom"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
     "tool_choice.allowed_tools"),
])
def test_chat_unsupported_fields_are_named(fields, expected):
    assert unsupported_fields(chat(**fields)) == expected


def test_chat_image_part_is_named_by_its_path():
    request = chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert unsupported_fields(request) == "messages[0].content[1].image_url"


@pytest.mark.parametrize("fields", [
    {"modalities": ["text"]}, {"response_format": {"type": "text"}}, {"tool_choice": "none"},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
    {"response_format": {"type": "json_object"}},
    {"function_call": "none"}, {"metadata": {"k": "v"}, "store": True, "service_tier": "auto",
                                "reasoning_effort": "low", "user": "u", "parallel_tool_calls": False},
])
def test_chat_default_or_ignorable_values_are_supported(fields):
    assert unsupported_fields(chat(**fields)) is None


# ---- tokenize ----

def test_tokenize_needs_exactly_one_of_prompt_and_messages():
    with pytest.raises(ValidationError):
        TokenizeRequest.model_validate({"prompt": "x", "messages": [{"role": "user", "content": "x"}]})


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function"}]),
    ("tool_choice", {"type": "function"}),
    ("messages", [{"role": "user", "content": [{"type": "image_url"}]}]),
])
def test_typed_object_without_its_payload_is_missing_a_parameter(field, value):
    with pytest.raises(ValidationError) as caught:
        chat(**{field: value})
    assert "missing_required_parameter" in [e["type"] for e in caught.value.errors()]
