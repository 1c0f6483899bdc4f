"""response_format and forced tool_choice as a grammar for the engine to enforce.

Schemas are checked here, before a request is queued: one the grammar engine cannot enforce is
a 400 that names what it cannot do, and never reaches the engine core.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tailrace.engine.structured_output.json_grammar import schema_error
from tailrace.sampling_params import StructuredSpec
from tailrace.serving.errors import invalid_request
from tailrace.serving.parsers import ToolParser
from tailrace.serving.parsers.forced import NamedCallParser, RequiredCallsParser
from tailrace.serving.protocol import ChatCompletionRequest, FunctionDefinition

ANY_OBJECT: dict[str, Any] = {"type": "object"}
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(slots=True)
class Constraint:
    spec: StructuredSpec
    # How tool calls the grammar forced are read back; None: the answer is plain content.
    tool_parser: Callable[[], ToolParser] | None = None


def constraint_for(request: ChatCompletionRequest, parallel_calls: bool) -> Constraint | None:
    """The grammar a chat request's answer must follow, or None. A forced tool choice wins over
    response_format: its answer must be the calls (several only with `parallel_calls`)."""
    forced = _forced_tool_choice(request, parallel_calls)
    if forced is not None:
        return forced
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return Constraint(_spec(ANY_OBJECT, "response_format", "response_format"))
    fmt = response_format.json_schema
    schema = fmt.schema_ if fmt.schema_ is not None else {}
    return Constraint(_spec(schema, f"response_format '{fmt.name}'", "response_format"))


def _forced_tool_choice(request: ChatCompletionRequest, parallel_calls: bool) -> Constraint | None:
    choice = request.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    functions = [tool.function for tool in request.tools or [] if tool.function is not None]
    if not functions:
        raise invalid_request("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                              "specified.", param="tool_choice")
    if choice == "required":
        for function in functions:
            _check_parameters(function)
        return Constraint(_spec(required_calls_schema(functions, parallel_calls),
                                "the tools together", "tools"), RequiredCallsParser)
    name = choice.function.name
    function = next((f for f in functions if f.name == name), None)
    if function is None:
        raise invalid_request(f"Invalid value for 'tool_choice': no function named '{name}' is in 'tools'.",
                              param="tool_choice")
    return Constraint(_spec(parameters_of(function), f"function '{name}'", "tools"),
                      functools.partial(NamedCallParser, name))


def parameters_of(function: FunctionDefinition) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else NO_PARAMETERS


def required_calls_schema(functions: list[FunctionDefinition], parallel: bool) -> dict[str, Any]:
    """At least one call (exactly one without parallel calls), each `{"name", "parameters"}` with
    the parameters of the function it names (the shape vLLM uses)."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [f.name]}, "parameters": parameters_of(f)},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _check_parameters(function: FunctionDefinition) -> None:
    """Each function on its own first, so that a 400 names the function at fault."""
    _spec(parameters_of(function), f"function '{function.name}'", "tools")


def _spec(schema: dict[str, Any], what: str, param: str) -> StructuredSpec:
    # Key order is kept: properties are generated in the order the schema lists them.
    spec = StructuredSpec(json.dumps(schema))
    error = schema_error(spec.json_schema)
    if error is not None:
        raise invalid_request(f"Invalid schema for {what}: {error}", param=param, code="invalid_json_schema")
    return spec
