"""OpenAI-shaped errors: constructors and the pydantic-error mapping."""

import pytest
from pydantic import ValidationError

from tailrace.serving import errors
from tailrace.serving.protocol import ChatCompletionRequest, CompletionRequest


def mapped(model, body: dict) -> errors.OpenAIError:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return errors.from_validation_errors(caught.value.errors(include_url=False))


def test_body_has_exactly_the_four_openai_keys():
    body = errors.invalid_request("bad", param="n", code="invalid_value").body()
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n",
                              "code": "invalid_value"}}


def test_context_length_message_is_openais_wording():
    err = errors.context_length_exceeded(100, 120, chat=True)
    assert err.message == ("Input tokens exceed the configured limit of 100 tokens. Your messages resulted "
                           "in 120 tokens. Please reduce the length of the messages.")


def test_context_length_names_messages_for_chat_and_prompt_for_completions():
    chat = errors.context_length_exceeded(100, 120, chat=True)
    completion = errors.context_length_exceeded(100, 120, chat=False)
    assert (chat.param, completion.param, chat.code) == ("messages", "prompt", "context_length_exceeded")


def test_completion_budget_names_the_param_and_the_room_left():
    err = errors.completion_budget_exceeded(100, 90, 20, "max_completion_tokens")
    assert (err.status, err.param, err.code) == (400, "max_completion_tokens", "invalid_value")
    assert err.message.startswith("max_completion_tokens is too large: 20.")
    assert "leaves at most 10 completion tokens" in err.message


def test_model_not_found_is_a_404_naming_the_model():
    err = errors.model_not_found("gpt-9")
    assert (err.status, err.message, err.code) == (
        404, "The model `gpt-9` does not exist or you do not have access to it.", "model_not_found")


@pytest.mark.parametrize("make,status,type_", [
    (errors.missing_api_key, 401, "invalid_request_error"),
    (lambda: errors.invalid_api_key("sk-1234567890"), 401, "invalid_request_error"),
    (lambda: errors.payload_too_large(10), 413, "invalid_request_error"),
    (errors.rate_limited, 429, "requests"),
    (errors.engine_unavailable, 503, "server_error"),
    (errors.internal, 500, "server_error"),
])
def test_constructor_status_and_type(make, status, type_):
    err = make()
    assert (err.status, err.type) == (status, type_)


@pytest.mark.parametrize("status,retryable", [(400, False), (401, False), (404, False), (413, False),
                                              (429, True), (500, True), (503, True)])
def test_retryable_only_for_rate_limits_and_server_errors(status, retryable):
    assert errors.OpenAIError(status, "x").retryable is retryable


def test_unsupported_parameter_names_the_field_and_its_top_level_param():
    err = errors.unsupported_parameter("messages[0].content[1].image_url")
    assert (err.message, err.param, err.code) == (
        "messages[0].content[1].image_url is not supported by this server", "messages", "unsupported_parameter")


def test_missing_required_field_maps_to_missing_required_parameter():
    err = mapped(CompletionRequest, {"prompt": "x"})
    assert (err.param, err.code, err.message) == (
        "model", "missing_required_parameter", "Missing required parameter: 'model'.")


def test_decimal_over_max_maps_to_decimal_above_max_value():
    err = mapped(CompletionRequest, {"model": "m", "prompt": "x", "temperature": 2.1})
    assert (err.param, err.code, err.message) == (
        "temperature", "decimal_above_max_value",
        "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 2.1 instead.")


def test_integer_under_min_maps_to_integer_below_min_value():
    err = mapped(CompletionRequest, {"model": "m", "prompt": "x", "n": 0})
    assert (err.param, err.code) == ("n", "integer_below_min_value")


def test_wrong_type_maps_to_invalid_type():
    err = mapped(CompletionRequest, {"model": "m", "prompt": "x", "temperature": "hot"})
    assert (err.param, err.code) == ("temperature", "invalid_type")


def test_union_error_reports_the_member_that_nearly_fit():
    err = mapped(CompletionRequest, {"model": "m", "prompt": [5, -1]})
    assert (err.param, err.code, err.message.split(":")[0]) == (
        "prompt", "integer_below_min_value", "Invalid 'prompt[1]'")


def test_nested_error_param_is_the_top_level_field_and_message_has_the_path():
    err = mapped(ChatCompletionRequest, {"model": "m", "messages": [{"role": "robot", "content": "x"}]})
    assert (err.param, err.code) == ("messages", "invalid_value")
    assert "'messages[0].role'" in err.message


def test_nested_missing_field_names_its_full_path():
    err = mapped(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user"}]})
    assert err.message == "Missing required parameter: 'messages[0].content'."


def test_empty_messages_maps_to_empty_array():
    err = mapped(ChatCompletionRequest, {"model": "m", "messages": []})
    assert (err.param, err.code) == ("messages", "empty_array")


def test_cross_field_rule_keeps_its_own_param_and_code():
    err = mapped(CompletionRequest, {"model": "m", "prompt": "x", "min_tokens": 5, "max_tokens": 2})
    assert (err.param, err.code) == ("min_tokens", "invalid_value")


def test_format_path_drops_union_member_tags():
    loc = ("messages", 0, "content", "list[function-after[_payload_present(), ContentPart]]", 1, "text")
    assert errors.format_path(loc) == "messages[0].content[1].text"
