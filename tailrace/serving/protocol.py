"""The OpenAI request schema for /v1/completions and /v1/chat/completions, plus vLLM's extensions.

Field names are OpenAI's. `null` means absent everywhere (clients send explicit nulls), and unknown
keys are ignored (`unknown_fields` names them for the log). JSON types are checked strictly. Ranges follow the OpenAI spec; a cross-field rule that fails raises a
`PydanticCustomError` whose type is the OpenAI error code and whose context names the `param`.
Fields the server knows but does not implement are accepted here and refused by
`unsupported_fields`, the one place to relax when a feature lands.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from tailrace.sampling_params import SamplingParams, SamplingParamsError
from tailrace.serving.errors import invalid_request

MAX_N = 128
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
MAX_BEST_OF = 20

TokenId = Annotated[int, Field(ge=0)]
TokenIdKey = Annotated[int, Field(ge=0, strict=False)]  # a JSON object's keys are strings: "50256"
# A float field's limits are floats and an int field's are ints: the error mapper reads the
# limit's type to say "decimal" or "integer" the way OpenAI does.
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class _OpenAIModel(BaseModel):
    # Strict: JSON types as OpenAI checks them ("stream": "yes", "n": "2" are 400s, not coerced);
    # an integer still passes where a number is expected, as JSON has one number type.
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


def _invalid(param: str, message: str, code: str = "invalid_value") -> PydanticCustomError:
    return PydanticCustomError(code, message, {"param": param})


def _missing(field: str) -> PydanticCustomError:
    """A field required by another field's value; the error's location is the enclosing object."""
    return PydanticCustomError("missing_required_parameter", "Missing required parameter: '{field}'.",
                               {"field": field})


# ---- sub-models ------------------------------------------------------------------------------

class StreamOptions(_OpenAIModel):
    include_usage: bool = False
    include_obfuscation: bool = True  # accepted for compatibility; the server never obfuscates
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _Tagged(_OpenAIModel):
    """An object whose `type` names the field that carries its payload (`{"type": "text", "text": ...}`)."""

    type: str

    @model_validator(mode="after")
    def _payload_present(self) -> _Tagged:
        if getattr(self, self.type) is None:
            raise _missing(self.type)
        return self


class ContentPart(_Tagged):
    """One part of a message's content. Only text and refusal parts are served; the others parse
    so that `unsupported_fields` can name them."""

    type: Literal["text", "refusal", "image_url", "input_audio", "file"]
    text: str | None = None
    refusal: str | None = None
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None


class FunctionCall(_OpenAIModel):
    name: str
    arguments: str = ""


class ToolCall(_OpenAIModel):
    """A tool call replayed in an assistant message (clients may add an `index`; it is ignored)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    refusal: str | None = None  # assistant
    reasoning: str | None = None  # assistant, vLLM: earlier reasoning replayed
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise _missing("content")
        if self.role == "tool" and self.tool_call_id is None:
            raise _missing("tool_call_id")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it: the fields the client set, content as one
        string, tool-call arguments as the object they encode (templates write them with
        `tojson`, so a JSON string would come out quoted twice), and earlier reasoning also as
        `thinking`."""
        fields = self.model_dump(exclude_none=True)
        fields["content"] = self.text()
        for call in fields.get("tool_calls", []):
            call["function"]["arguments"] = _json_object_or_text(call["function"]["arguments"])
        thinking = self.reasoning_content or self.reasoning
        if thinking:  # gpt-oss's template reads an earlier turn's analysis as `thinking`
            fields["thinking"] = thinking
        return fields

    def text(self) -> str:
        """The content as one string: text (and refusal) parts joined; other parts add nothing, and
        `unsupported_fields` refuses them before generation."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or part.refusal or "" for part in self.content)


def _json_object_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(_OpenAIModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Tagged):
    type: Literal["function", "custom"] = "function"
    function: FunctionDefinition | None = None
    custom: dict[str, Any] | None = None


class ToolChoiceFunction(_OpenAIModel):
    name: str


class NamedToolChoice(_Tagged):
    """`{"type": "function", "function": {"name"}}`, or the custom / allowed_tools forms."""

    type: Literal["function", "custom", "allowed_tools"]
    function: ToolChoiceFunction | None = None
    custom: dict[str, Any] | None = None
    allowed_tools: dict[str, Any] | None = None


class JsonSchemaFormat(_OpenAIModel):
    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise _missing("json_schema")
        return self


# ---- shared sampling fields ------------------------------------------------------------------

class _SamplingRequest(_OpenAIModel):
    """Fields both endpoints share: OpenAI's sampling settings and vLLM's extensions."""

    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: Temperature = 1.0
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[TokenIdKey, Bias] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False

    @model_validator(mode="after")
    def _check_shared(self) -> _SamplingRequest:
        # How many stop strings, and how long, is the operator's cap: serving/limits.py.
        limit = self.effective_max_tokens
        if limit is not None and self.min_tokens > limit:
            raise _invalid("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({limit}).")
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        """The requested completion limit, or None when the client set none."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage_stats(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                n=self.n, temperature=self.temperature,
                # OpenAI allows top_p=0; the sampler wants (0, 1]. A tiny mass keeps only the best token.
                top_p=max(self.top_p, 1e-9), top_k=self.top_k, min_p=self.min_p,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias={int(k): float(v) for k, v in (self.logit_bias or {}).items()},
                seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                stop=stop, stop_token_ids=list(self.stop_token_ids or []),
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except SamplingParamsError as err:
            raise invalid_request(str(err), param=err.param) from err


# ---- the two requests ------------------------------------------------------------------------

Prompt = (str | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
          | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])


def prompt_list(prompt: Prompt) -> list[str | list[int]]:
    """The prompts a `Prompt` holds: one text or token-id list, or each of several."""
    return [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. `max_tokens` absent means OpenAI's default of 16."""

    prompt: Prompt
    best_of: int | None = Field(default=None, ge=0, le=MAX_BEST_OF)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise _invalid("best_of", f"best_of ({self.best_of}) must be greater than or equal to n ({self.n}).")
        return self

    def to_sampling_params(self, default_max_tokens: int | None = 16) -> SamplingParams:
        """`logprobs=k` asks for k alternatives per generated token; with `echo`, per prompt token too."""
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions.

    Both `max_tokens` (deprecated, LiteLLM sends it) and `max_completion_tokens` (ChatOpenAI sends
    it) are honoured; when both are set, `max_completion_tokens` wins. Absent both, generation may
    run up to the context limit.
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None  # a template variable (chat.template_variables)
    # Known OpenAI fields that change nothing here: accepted and ignored.
    metadata: dict[str, str] | None = None
    store: bool = False
    service_tier: str | None = None
    verbosity: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    # Known OpenAI fields the server does not implement: refused by `unsupported_fields` when set.
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM extensions
    echo: bool = False  # the response starts with the last message's content when its role matches
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("top_logprobs", "Invalid value for 'top_logprobs': 'logprobs' must be set to true "
                                           "when 'top_logprobs' is used.")
        if self.continue_final_message:
            if "add_generation_prompt" not in self.model_fields_set:
                # Continuing the last message excludes opening a new one; only an explicit true conflicts.
                self.add_generation_prompt = False
            elif self.add_generation_prompt:
                raise _invalid("continue_final_message", "Cannot set both 'continue_final_message' and "
                                                         "'add_generation_prompt' to true.")
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def to_sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        """`logprobs=true` with `top_logprobs=k` asks for k alternatives per token (0 when absent)."""
        requested = self.effective_max_tokens
        max_tokens = requested if requested is not None else default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, None)


# ---- what the server refuses ---------------------------------------------------------------------

def unsupported_fields(request: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The first known field set to something this server does not implement, as a path, or None."""
    if isinstance(request, CompletionRequest):
        if request.suffix:
            return "suffix"
        if request.best_of is not None and request.best_of > request.n:
            return "best_of"
        return None
    for name in ("audio", "prediction", "web_search_options", "moderation", "functions"):
        if getattr(request, name) is not None:
            return name
    if request.function_call not in (None, "none", "auto"):
        return "function_call"
    if request.modalities is not None and any(m != "text" for m in request.modalities):
        return "modalities"
    for i, message in enumerate(request.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            if part.type not in ("text", "refusal"):
                return f"messages[{i}].content[{j}].{part.type}"
    for i, tool in enumerate(request.tools or []):
        if tool.type == "custom":
            return f"tools[{i}].custom"
    if isinstance(request.tool_choice, NamedToolChoice) and request.tool_choice.type != "function":
        return f"tool_choice.{request.tool_choice.type}"
    return None


def unknown_fields(model: type[BaseModel], data: dict[str, Any]) -> list[str]:
    """The top-level keys of a request body that `model` does not know. Nested objects are not
    checked: clients routinely replay extra keys there (a tool call's stream `index`)."""
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    return sorted(set(data) - known)


# ---- tokenizer endpoints ---------------------------------------------------------------------------

class TokenizeRequest(_OpenAIModel):
    """POST /tokenize: a plain `prompt`, or chat `messages` rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Absent: True for a prompt, False for messages (the chat template writes its own special tokens).
    add_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _invalid("prompt", "Send exactly one of 'prompt' and 'messages'.",
                           code="missing_required_parameter")
        if self.continue_final_message and "add_generation_prompt" not in self.model_fields_set:
            self.add_generation_prompt = False
        return self


class DetokenizeRequest(_OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]
