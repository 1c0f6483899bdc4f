"""A JSON schema as the llguidance grammar that enforces it, and why a schema cannot be enforced:
what the serving side checks before a request is queued and the core compiles, without PyTorch."""

from __future__ import annotations

import json
from collections.abc import Iterator

import llguidance

from tailrace.sampling_params import StructuredSpec

# Fixed separators and no free whitespace: the JSON reads like json.dumps output, and a weak
# model cannot spend its whole budget on whitespace between tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_grammar(spec: StructuredSpec) -> str:
    """The llguidance grammar for the spec; ValueError when the schema is not a JSON object."""
    return llguidance.LLMatcher.grammar_from_json_schema(spec.json_schema, defaults=JSON_OPTIONS)


def schema_error(json_schema: str) -> str | None:
    """Why the schema cannot be enforced (llguidance names the feature, e.g. `Unimplemented keys:
    ["not"]`), or None when it can. About 0.3 ms for a typical schema: cheap enough to run on
    every request before it is queued (and no cache of client-sized strings to bound)."""
    try:
        grammar = json_grammar(StructuredSpec(json_schema))
    except ValueError as err:
        return str(err)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return messages[0]
    return next(filter(None, map(_open_integer_bound, _subschemas(json.loads(json_schema)))), None)


# Values that are data, not schemas: a dict under them is not checked.
_DATA_KEYS = {"const", "enum", "default", "examples"}


def _subschemas(value: object) -> Iterator[dict]:
    """Every dict in a schema outside its data values, the schema itself first."""
    if isinstance(value, dict):
        yield value
        for key, item in value.items():
            if key not in _DATA_KEYS:
                yield from _subschemas(item)
    elif isinstance(value, list):
        for item in value:
            yield from _subschemas(item)


def _open_integer_bound(schema: dict) -> str | None:
    """llguidance 1.9.1 lets the number k itself through when a number's range lies within one
    unit past an exclusive integer bound k: exclusiveMinimum k >= 0 with an upper bound under
    k + 1 (k = 0 with maximum 0.25 accepts 0), or exclusiveMaximum k <= 0 with a lower bound over
    k - 1 (k = 0 accepts -0). Such a schema is refused rather than answered with a number it
    forbids."""
    if schema.get("type") != "number":
        return None
    bounds = {key: schema[key] for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
              if isinstance(schema.get(key), (int, float)) and not isinstance(schema[key], bool)}
    low, high = bounds.get("exclusiveMinimum"), bounds.get("exclusiveMaximum")
    upper = min((bounds[k] for k in ("maximum", "exclusiveMaximum") if k in bounds), default=None)
    lower = max((bounds[k] for k in ("minimum", "exclusiveMinimum") if k in bounds), default=None)
    if low is not None and float(low).is_integer() and low >= 0 and upper is not None and upper < low + 1:
        return (f"exclusiveMinimum {low} with a maximum under {low + 1} cannot be enforced (the grammar "
                f"would also allow {low}); use a minimum above {low} instead")
    if high is not None and float(high).is_integer() and high <= 0 and lower is not None and lower > high - 1:
        return (f"exclusiveMaximum {high} with a minimum over {high - 1} cannot be enforced (the grammar "
                f"would also allow {high}); use a maximum under {high} instead")
    return None
