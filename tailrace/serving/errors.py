"""Errors in the OpenAI wire shape: each carries its HTTP status and the four fields clients read."""

from __future__ import annotations

import re
from typing import Any

# Statuses a client may usefully retry (the SDK retries these by default); every other 4xx is final.
RETRYABLE_STATUSES = frozenset({408, 409, 429})


class OpenAIError(Exception):
    """An error the API answers with `{"error": {message, type, param, code}}` and `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers: dict[str, str] = {}  # extra response headers, e.g. retry-after on a 429

    @property
    def retryable(self) -> bool:
        return self.status >= 500 or self.status in RETRYABLE_STATUSES

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def unsupported_parameter(field: str) -> OpenAIError:
    """`field` may be a path like `messages[0].content[1].image_url`; `param` is its top-level name."""
    return invalid_request(f"{field} is not supported by this server", param=top_level(field),
                           code="unsupported_parameter")


def context_length_exceeded(limit: int, prompt_tokens: int, chat: bool) -> OpenAIError:
    """A prompt that leaves no room in the context. OpenAI's current wording, which LangChain and
    LiteLLM both recognise as a context overflow; keep it verbatim."""
    message = (f"Input tokens exceed the configured limit of {limit} tokens. Your messages resulted in "
               f"{prompt_tokens} tokens. Please reduce the length of the messages.")
    return invalid_request(message, param="messages" if chat else "prompt", code="context_length_exceeded")


def completion_budget_exceeded(limit: int, prompt_tokens: int, max_tokens: int, param: str) -> OpenAIError:
    """A prompt that fits, with more completion tokens asked for than the context has left. It
    starts as OpenAI's "max_tokens is too large" does and names the room that is left."""
    return invalid_request(f"{param} is too large: {max_tokens}. The context holds {limit} tokens and the prompt "
                           f"uses {prompt_tokens}, which leaves at most {limit - prompt_tokens} completion tokens; "
                           f"lower {param} or shorten the prompt.", param=param)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")


def missing_api_key() -> OpenAIError:
    """OpenAI's answer to a request with no key (its wording, less the link to its own site)."""
    return OpenAIError(401, "You didn't provide an API key. You need to provide your API key in an Authorization "
                            "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).", code=None)


def invalid_api_key(sent: str) -> OpenAIError:
    """OpenAI's answer to a wrong key: it shows the key masked, enough to tell which one was sent."""
    masked = f"{sent[:3]}{'*' * 4}{sent[-4:]}" if len(sent) >= 12 else "*" * 4
    return OpenAIError(401, f"Incorrect API key provided: {masked}.", code="invalid_api_key")


def payload_too_large(limit_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than the limit of {limit_bytes} bytes.",
                       code="payload_too_large")


def rate_limited(message: str = "Too many requests. Please retry after a short wait.") -> OpenAIError:
    return OpenAIError(429, message, type="requests", code="rate_limit_exceeded")


def request_timeout(seconds: float) -> OpenAIError:
    """The request ran past --request-timeout and was aborted (408: clients and LiteLLM read it as a timeout)."""
    return OpenAIError(408, f"The request did not finish within this server's limit of {seconds:g} s.",
                       type="timeout_error", code="request_timeout")


def engine_unavailable(message: str = "The engine is not available. Please retry shortly.") -> OpenAIError:
    return OpenAIError(503, message, type="server_error", code="engine_unavailable")


def internal(message: str = "The server had an error while processing your request.") -> OpenAIError:
    """A 500 that never carries a stack trace or exception text: log those, don't send them."""
    return OpenAIError(500, message, type="server_error", code="internal_error")


def invalid_json() -> OpenAIError:
    return invalid_request("We could not parse the JSON body of your request. The API expects a JSON object.",
                           code=None)


def top_level(path: str) -> str:
    """`messages[0].role` -> `messages`: the field name OpenAI puts in `param`."""
    return re.split(r"[.\[]", path, maxsplit=1)[0]


# ---- pydantic validation errors -> one OpenAI 400 ------------------------------------------------

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a decimal", str: "a string",
               list: "an array", dict: "an object", type(None): "null"}
# pydantic's bound errors: (context key, operator, side of the bound)
_BOUNDS = {"less_than_equal": ("le", "<=", "above"), "less_than": ("lt", "<", "above"),
           "greater_than_equal": ("ge", ">=", "below"), "greater_than": ("gt", ">", "below")}
# pydantic's "Input should be a valid integer" as OpenAI says it: "expected an integer".
_EXPECTED = {"a valid boolean": "a boolean", "a valid integer": "an integer", "a valid number": "a number",
             "a valid string": "a string", "a valid list": "an array", "a valid dictionary": "an object"}
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def from_validation_errors(errors: list[dict[str, Any]]) -> OpenAIError:
    """Turn pydantic's error list (locations relative to the request body) into one OpenAI 400.

    `param` is the top-level field; the message names the full path (`messages[0].role`).
    """
    if not errors:
        return invalid_request("Invalid request body.")
    error = _most_telling(errors)
    loc = tuple(error.get("loc", ()))
    ctx = error.get("ctx") or {}
    kind = error["type"]
    if kind == "json_invalid":
        return invalid_json()
    if not loc and "param" in ctx:  # a cross-field rule that names its own param and message
        return invalid_request(error["msg"], param=ctx["param"], code=kind)
    path = format_path(loc)
    code, message = _describe(kind, path, error, ctx)
    return invalid_request(message, param=top_level(path) or None, code=code)


def format_path(loc: tuple[Any, ...]) -> str:
    """A pydantic location as OpenAI writes it, without pydantic's union-member tags."""
    path = ""
    for part in loc:
        if isinstance(part, int) or (isinstance(part, str) and part.isdigit()):
            path += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", str(part)) and part not in _UNION_TAGS:
            path += f".{part}" if path else part
    return path


def _most_telling(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Of the first offending field's errors, prefer one that is not a type mismatch: for a union
    (`stop: str | list[str]`) the mismatching members say less than the member that nearly fit."""
    first = errors[0].get("loc", ())[:1]
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:1] == tuple(first)]
    telling = [e for e in same_field if not _is_type_mismatch(e["type"])]
    return (telling or same_field)[0]


def _is_type_mismatch(kind: str) -> bool:
    return kind.endswith(("_type", "_parsing")) or kind in ("model_attributes_type", "int_from_float")


def _describe(kind: str, path: str, error: dict[str, Any], ctx: dict[str, Any]) -> tuple[str, str]:
    value = error.get("input")
    if kind in ("missing", "missing_required_parameter"):
        full = f"{path}.{ctx['field']}" if "field" in ctx and path else ctx.get("field", path)
        return "missing_required_parameter", f"Missing required parameter: '{full}'."
    if kind in _BOUNDS:
        bound, op, side = _BOUNDS[kind]
        number = "decimal" if isinstance(ctx[bound], float) else "integer"
        extreme = "maximum" if side == "above" else "minimum"
        return f"{number}_{side}_{extreme[:3]}_value", (
            f"Invalid '{path}': {number} {side} {extreme} value. Expected a value {op} "
            f"{_number(ctx[bound])}, but got {_number(value)} instead.")
    if kind == "too_long":
        return "array_above_max_length", (
            f"Invalid '{path}': array too long. Expected an array with maximum length {ctx['max_length']}, "
            f"but got an array with length {ctx['actual_length']} instead.")
    if kind == "too_short":
        if ctx.get("actual_length") == 0:
            return "empty_array", (f"Invalid '{path}': empty array. Expected an array with minimum length "
                                   f"{ctx['min_length']}, but got an empty array instead.")
        return "array_below_min_length", (
            f"Invalid '{path}': array too short. Expected an array with minimum length {ctx['min_length']}, "
            f"but got an array with length {ctx['actual_length']} instead.")
    if kind in ("literal_error", "enum"):
        return "invalid_value", f"Invalid value for '{path}': {value!r}. Supported values are: {ctx['expected']}."
    if _is_type_mismatch(kind):
        expected = error["msg"].removeprefix("Input should be ").split(",")[0]
        expected = _EXPECTED.get(expected, expected)
        got = _TYPE_NAMES.get(type(value), "a value of another type")
        return "invalid_type", f"Invalid type for '{path}': expected {expected}, but got {got} instead."
    return "invalid_value", f"Invalid value for '{path}': {error['msg']}."


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
