"""Hypothesis strategies for the JSON Schemas that structured-output closing is tested on: nested
objects with required and optional properties, arrays with item bounds, enums, anchored
patterns, strings with length bounds, and integers and numbers with bounds."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

NAMES = st.sampled_from(["id", "name", "tags", "a", "b", "zip", "score", "note", "kind", "items", "é"])
PATTERNS = st.sampled_from([
    "^[0-9]{5}$", "^[a-z]+$", "^(yes|no)$", "^[A-Z][a-z]{2,6}$", r"^\d{3}-\d{4}$", "^x*y?$",
    "^(ab)+$", "^[a-f0-9]{1,8}$", r"^\w+@\w+\.com$",
])
ENUM_VALUES = st.one_of(st.integers(-50, 50), st.text("abcxyz é", max_size=6), st.booleans(), st.none())


@st.composite
def _string(draw) -> dict[str, Any]:
    kind = draw(st.sampled_from(["free", "bounded", "pattern"]))
    if kind == "pattern":
        return {"type": "string", "pattern": draw(PATTERNS)}
    schema: dict[str, Any] = {"type": "string"}
    if kind == "bounded":
        low = draw(st.integers(0, 4))
        schema["minLength"] = low
        if draw(st.booleans()):
            schema["maxLength"] = low + draw(st.integers(0, 12))
    return schema


@st.composite
def _number(draw) -> dict[str, Any]:
    integer = draw(st.booleans())
    schema: dict[str, Any] = {"type": "integer" if integer else "number"}
    value = st.integers(-2000, 2000) if integer else st.integers(-2000, 2000).map(lambda v: v / 4)
    low, high = draw(value), draw(value)
    low, high = min(low, high), max(low, high)
    # An exclusive bound at least one unit from the other: schema_error refuses the ranges closer
    # than that past an integer bound (llguidance lets the bound itself through).
    if draw(st.booleans()):
        schema["exclusiveMinimum" if draw(st.booleans()) and low <= high - 1 else "minimum"] = low
    if draw(st.booleans()):
        schema["exclusiveMaximum" if draw(st.booleans()) and low < high - 1 else "maximum"] = high
    return schema


LEAVES = st.one_of(
    _string(), _number(),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}]),
    st.lists(ENUM_VALUES, min_size=1, max_size=4, unique_by=repr).map(lambda v: {"enum": v}),
)


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(_object(children), _array(children))


@st.composite
def _object(draw, children) -> dict[str, Any]:
    names = draw(st.lists(NAMES, max_size=4, unique=True))
    properties = {name: draw(children) for name in names}
    required = [name for name in names if draw(st.booleans())]
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if draw(st.integers(0, 3)) > 0:
        schema["additionalProperties"] = False
    return schema


@st.composite
def _array(draw, children) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "array", "items": draw(children)}
    low = draw(st.integers(0, 3))
    if low:
        schema["minItems"] = low
    if draw(st.booleans()):
        schema["maxItems"] = low + draw(st.integers(0, 3))
    return schema


VALUES = st.recursive(LEAVES, _containers, max_leaves=6)
SCHEMAS = _containers(VALUES)  # a document is an object or an array
OBJECT_SCHEMAS = _object(VALUES)  # a tool's parameters
