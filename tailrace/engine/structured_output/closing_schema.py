"""A JSON Schema as the closer reads it: for each node, the shortest value it allows, as the
grammar writes it (`", "` and `": "` separators, properties in schema order), and `bound`, the
longest ending the closer can give from anywhere inside a value of it (a budget at least that
large needs no closing work yet).

Only what can be completed correctly is taken; anything else raises `Unsupported`, and the
engine then enforces the schema without closing (see engine/structured_output/grammar.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from tailrace.engine.structured_output.regex_closing import PatternDfa, Unsupported

ANY, OBJECT, ARRAY, STRING, NUMBER, LITERALS, CHOICE = "any", "object", "array", "string", "number", "literals", "choice"
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$comment", "deprecated",
                "readOnly", "writeOnly"}
_KEYWORDS = {
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
    "string": {"minLength", "maxLength", "pattern"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "boolean": set(), "null": set(),
}


@dataclass(eq=False)
class Node:
    kind: str
    min_text: bytes = b""
    # No ending from inside a value of this node (its own tail and those of the values open
    # within it) is longer than this; infinite where values of any type may nest without end.
    bound: float = math.inf
    # OBJECT: (key as JSON text without its quotes, node); required names; None: no others
    properties: list[tuple[bytes, "Node"]] = field(default_factory=list)
    required: frozenset[bytes] = frozenset()
    additional: "Node | None" = None
    item: "Node | None" = None  # ARRAY
    min_items: int = 0
    max_items: int | None = None
    min_length: int = 0  # STRING (in characters)
    pattern: PatternDfa | None = None
    integer: bool = False  # NUMBER
    low: Fraction | None = None
    high: Fraction | None = None
    low_open: bool = False
    high_open: bool = False
    # OBJECT: for each position in properties, `, "key": value` of every required one from there
    rest_after: list[bytes] = field(default_factory=list)
    texts: list[bytes] = field(default_factory=list)  # LITERALS, as the grammar writes them
    options: list["Node"] = field(default_factory=list)  # CHOICE

    @property
    def bounded(self) -> bool:
        return self.low is not None or self.high is not None


def compile_schema(schema: Any) -> Node:
    """The closer's view of a schema; Unsupported for what it cannot complete."""
    node = _node(schema)
    _measure(node)
    return node


def _node(schema: Any) -> Node:
    if schema is True or schema == {}:
        return Node(ANY)
    if not isinstance(schema, dict):
        raise Unsupported(f"schema {schema!r}")
    keys = set(schema) - _ANNOTATIONS
    if "enum" in keys or "const" in keys:
        return _literals(schema, keys)
    if "anyOf" in keys:
        if keys != {"anyOf"} or not schema["anyOf"]:
            raise Unsupported("anyOf beside other keywords")
        return Node(CHOICE, options=[_node(option) for option in schema["anyOf"]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return Node(CHOICE, options=[_node({**schema, "type": k}) for k in kind])
    if kind not in _KEYWORDS:
        if keys:
            raise Unsupported(f"keywords {sorted(keys)} without a single type")
        return Node(ANY)
    extra = keys - {"type"} - _KEYWORDS[kind]
    if extra:
        raise Unsupported(f"{sorted(extra)} on a {kind}")
    if kind == "object":
        return _object(schema)
    if kind == "array":
        max_items = schema.get("maxItems")
        return Node(ARRAY, item=_node(schema.get("items", {})), min_items=schema.get("minItems", 0),
                    max_items=max_items)
    if kind == "string":
        if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
            raise Unsupported("pattern together with minLength or maxLength")
        pattern = PatternDfa(schema["pattern"]) if "pattern" in schema else None
        return Node(STRING, min_length=schema.get("minLength", 0), pattern=pattern)
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    return Node(LITERALS, texts=[b"true", b"false"] if kind == "boolean" else [b"null"])


def _literals(schema: dict, keys: set[str]) -> Node:
    if keys - {"enum", "const", "type"}:
        raise Unsupported(f"{sorted(keys - {'enum', 'const', 'type'})} beside enum or const")
    values = schema["enum"] if "enum" in schema else [schema["const"]]
    texts = [json.dumps(v, separators=(", ", ": "), ensure_ascii=False).encode() for v in values]
    if not texts:
        raise Unsupported("an empty enum")
    return Node(LITERALS, texts=texts)


def _object(schema: dict) -> Node:
    properties = [(_key(name), _node(sub)) for name, sub in schema.get("properties", {}).items()]
    required = frozenset(_key(name) for name in schema.get("required", []))
    if not required <= {key for key, _ in properties}:
        raise Unsupported("a required property that is not in properties")
    extra = schema.get("additionalProperties", True)
    return Node(OBJECT, properties=properties, required=required,
                additional=None if extra is False else _node(extra))


def _key(name: str) -> bytes:
    return json.dumps(name, ensure_ascii=False).encode()[1:-1]


def _number(schema: dict, integer: bool) -> Node:
    node = Node(NUMBER, integer=integer)
    for name, attr, open_attr, is_open in (("minimum", "low", "low_open", False), ("maximum", "high", "high_open", False),
                                           ("exclusiveMinimum", "low", "low_open", True),
                                           ("exclusiveMaximum", "high", "high_open", True)):
        if name in schema:
            value = schema[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise Unsupported(f"{name} {value!r}")
            setattr(node, attr, Fraction(str(value)))
            setattr(node, open_attr, is_open)
    return node


def _measure(node: Node) -> None:
    """Fill min_text (and an object's rest_after), children first."""
    for child in _children(node):
        _measure(child)
    node.min_text = _shortest(node)
    node.bound = _bound(node)


def _children(node: Node) -> list[Node]:
    out = [sub for _, sub in node.properties] + node.options
    return out + [n for n in (node.additional, node.item) if n is not None]


def _shortest(node: Node) -> bytes:
    if node.kind == ANY:
        return b"0"
    if node.kind == OBJECT:
        members = [b'"' + key + b'": ' + sub.min_text for key, sub in node.properties if key in node.required]
        node.rest_after = [b"".join(b', "' + key + b'": ' + sub.min_text
                                    for key, sub in node.properties[pos:] if key in node.required)
                           for pos in range(len(node.properties) + 1)]
        return b"{" + b", ".join(members) + b"}"
    if node.kind == ARRAY:
        return b"[" + b", ".join([node.item.min_text] * node.min_items) + b"]"
    if node.kind == STRING:
        if node.pattern is not None:
            return b'"' + node.pattern.ending(0) + b'"'
        return b'"' + b"a" * node.min_length + b'"'
    if node.kind == NUMBER:
        text = number_ending(node, "")
        if text is None:
            raise Unsupported("a number range that holds no value")
        return text.encode()
    if node.kind == LITERALS:
        return min(node.texts, key=len)
    return min((o.min_text for o in node.options), key=len)


_OPEN_TAIL = 4  # the most an escape (`\\u` + 4 hex) or a UTF-8 character a token left open needs
_NUMBER_TAIL = 33  # a sign and what number_ending's search can add (under 32 characters)


def _bound(node: Node) -> float:
    """The longest ending the closer can give from inside a value of this node: over the frame's
    states (see json_closing, each tail over-counted), its own tail, plus, where a value is open
    inside it, that value's bound."""
    if node.kind == ANY:
        return math.inf
    inner = max((child.bound for child in _children(node)), default=0)
    if node.kind == OBJECT:
        # Between members or in a key: `, "`, the key's rest, `": `, its shortest value, the
        # required members after it and `}`; a free key (no required one left) may need an open
        # escape closed and underscores to keep it apart from every defined key.
        defined = max((len(key) + len(sub.min_text) + len(node.rest_after[i + 1])
                       for i, (key, sub) in enumerate(node.properties)), default=0)
        free = 0
        if node.additional is not None:
            longest_key = max((len(key) for key, _ in node.properties), default=0)
            free = _OPEN_TAIL + longest_key + len(node.properties) + len(node.additional.min_text)
        key = max(defined, free) + 8
        # Inside a member's value the object's own tail is the required members after it and `}`.
        members = [(node.rest_after[i + 1], sub) for i, (_, sub) in enumerate(node.properties)]
        if node.additional is not None:
            members.append((node.rest_after[-1], node.additional))
        inside = max((len(rest) + 1 + sub.bound for rest, sub in members), default=0)
        return max(len(node.min_text), key + 1, inside)
    if node.kind == ARRAY:
        # Between items: ` `, an item and the ones still required; inside one, at most those.
        return len(node.min_text) + max(len(node.item.min_text) + 2, inner)
    if node.kind == STRING:
        rest = max((d for d in node.pattern.dist if d >= 0)) if node.pattern is not None else node.min_length
        return max(len(node.min_text), _OPEN_TAIL + rest + 1)
    if node.kind == NUMBER:
        return max(len(node.min_text), _NUMBER_TAIL)
    if node.kind == LITERALS:
        return max(map(len, node.texts))
    return max(len(node.min_text), inner)  # CHOICE: before its first byte, then one option's frames


def number_ending(node: Node, prefix: str) -> str | None:
    """The shortest text that completes `prefix` (a number's start, as generated) into a number
    the grammar ends, or None when there is none. Without bounds any JSON number. With bounds the
    grammar writes no exponent, and it refuses some negative zeros and some fractions that end in
    0 (-0.50, -0.0, or 0.7500 at a bound of 0.75) while it takes others (255.0 at a maximum of
    255): an ending makes neither where it can, a fraction ending in 0 only where the prefix
    leaves nothing else (`255.` at that maximum), and ends a prefix as it stands only where that
    is all the grammar can have let through (`-0` for an integer)."""
    if not node.bounded:
        if prefix in ("", "-"):
            return "1" if prefix == "-" else "0"
        return "0" if prefix[-1] in ".eE+-" else ""
    if not prefix:  # either sign
        positive, negative = _bounded_ending(node, ""), _bounded_ending(node, "-")
        endings = [e for e in (positive, None if negative is None else "-" + negative) if e is not None]
        return min(endings, key=len, default=None)
    for zeros in (False, True):
        ending = _bounded_ending(node, prefix, zeros)
        if ending is not None:
            return ending
    return "" if number_complete(node, prefix) else None


def number_complete(node: Node, text: str) -> bool:
    """Whether `text`, as the grammar wrote it, is a whole number the node allows: its value
    decides, however it is written (`3.0`, `-0`, `254.50`), so every number the grammar ends is
    one the closer follows."""
    if not text or not text[-1].isdigit():
        return False
    if not node.bounded:
        return True
    if node.integer and "." in text:
        return False
    value = Fraction(text)
    return not ((node.low is not None and (value < node.low or (node.low_open and value == node.low))) or
                (node.high is not None and (value > node.high or (node.high_open and value == node.high))))


def _bounded_ending(node: Node, prefix: str, zeros: bool = False) -> str | None:
    negative = prefix.startswith("-")
    whole, dot, frac = prefix[negative:].partition(".")
    for extra in range(32):
        # Split the extra characters between integer digits, a dot and fraction digits.
        if dot:
            splits = [(0, extra)]
        else:
            splits = [(extra, None)] + ([] if node.integer else [(a, extra - a - 1) for a in range(extra)])
        for int_digits, frac_digits in splits:
            found = _smallest_in_range(node, negative, whole, int_digits, frac if dot else None, frac_digits, zeros)
            if found is not None and found.startswith(prefix):
                return found[len(prefix):]
    return None


def _smallest_in_range(node: Node, negative: bool, whole: str, int_digits: int, frac: str | None,
                       frac_digits: int | None, zeros: bool) -> str | None:
    """The allowed number of smallest magnitude written as `whole` plus `int_digits` free digits,
    then (when frac_digits is not None) a dot, `frac` and `frac_digits` free digits; None if none.
    A fraction ending in 0 only with `zeros`; never a negative zero."""
    if (not whole and not int_digits) or (whole.startswith("0") and (len(whole) > 1 or int_digits)):
        return None  # no integer part, or a leading zero
    if frac_digits is not None and not (frac or "") and not frac_digits:
        return None  # a dot needs a digit after it
    frac = frac or ""
    places = len(frac) + (frac_digits or 0)
    step = Fraction(1, 10 ** places)
    low_int = int(whole or "0") * 10 ** int_digits
    if not whole and int_digits > 1:
        low_int = 10 ** (int_digits - 1)
    high_int = int(whole or "0") * 10 ** int_digits + 10 ** int_digits - 1
    base = Fraction(int(frac or "0"), 10 ** len(frac))
    mag_low = low_int + base
    mag_high = high_int + base + Fraction(10 ** (frac_digits or 0) - 1, 10 ** places)
    lo, hi, lo_open, hi_open = node.low, node.high, node.low_open, node.high_open
    if negative:  # value = -magnitude
        lo, hi, lo_open, hi_open = (None if hi is None else -hi), (None if lo is None else -lo), hi_open, lo_open
    start = mag_low
    if lo is not None and lo > start:
        start = mag_low + math.ceil((lo - mag_low) / step) * step
    if (lo is not None and lo_open and start == lo) or (negative and start == 0):
        start += step
    while frac_digits is not None and not zeros and (start * 10 ** places) % 10 == 0:
        start += step
    if start > mag_high or (hi is not None and (start > hi or (hi_open and start == hi))):
        return None
    text = ("-" if negative else "") + str(int(start))
    if frac_digits is not None:
        text += "." + str(int((start - int(start)) * 10 ** places)).zfill(places)
    return text
