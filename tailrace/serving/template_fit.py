"""What a model's chat template takes of a conversation with tool calls, found once at start-up
by rendering a probe through it, as llama.cpp probes a template's capabilities: whether an
assistant turn may hold several calls (Llama 3.x's templates refuse two), and whether call ids
must be short (Mistral's templates take exactly 9 alphanumeric characters, and vLLM too keeps
the last 9)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tailrace.serving.context import ChatOptions
from tailrace.serving.protocol import ChatMessage

if TYPE_CHECKING:
    from tailrace.tokenizer import Tokenizer

SHORT_CALL_ID = 9
# Ids as the server issues them (chat.py): what a client sends back.
_PROBE_IDS = ("call_" + "0123456789abcdef01234567", "call_" + "89abcdef0123456789abcdef")
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "A probe", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}}}}


def fit_to_template(options: ChatOptions, tokenizer: Tokenizer) -> tuple[ChatOptions, str]:
    """`options` with what the template takes of tool calls, and one line that says it."""
    if tokenizer.chat_template is None:
        return options, "tool calls in the chat template: no template"
    for parallel in (True, False):
        for id_length in (None, SHORT_CALL_ID):
            if _renders(tokenizer, 2 if parallel else 1, id_length):
                line = (f"tool calls in the chat template: {'several' if parallel else 'one'} per turn, ids "
                        f"{'as issued' if id_length is None else f'cut to their last {id_length} characters'}")
                return replace(options, parallel_calls=parallel, call_id_length=id_length), line
    return options, "tool calls in the chat template: it renders no probe conversation with a call"


def fit_call_ids(messages: list[dict[str, Any]], length: int | None) -> list[dict[str, Any]]:
    """`messages` (template dicts) with each call id, in the calls and in the results that answer
    them, cut to its last `length` letters and digits (None: as they are)."""
    if length is None:
        return messages
    for message in messages:
        for call in message.get("tool_calls", []):
            if "id" in call:
                call["id"] = _short(call["id"], length)
        if "tool_call_id" in message:
            message["tool_call_id"] = _short(message["tool_call_id"], length)
    return messages


def _short(call_id: str, length: int) -> str:
    return re.sub(r"[^A-Za-z0-9]", "", call_id)[-length:]


def _renders(tokenizer: Tokenizer, calls: int, id_length: int | None) -> bool:
    ids = [_short(i, id_length) if id_length else i for i in _PROBE_IDS[:calls]]
    messages = [{"role": "user", "content": "Probe twice."},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": "probe", "arguments": f'{{"n": {n}}}'}}
                    for n, i in enumerate(ids)]},
                *({"role": "tool", "tool_call_id": i, "content": str(n)} for n, i in enumerate(ids))]
    try:
        tokenizer.apply_chat_template([ChatMessage.model_validate(m).template_dict() for m in messages],
                                      add_generation_prompt=True, tools=[_PROBE_TOOL])
    except ValueError:
        return False
    return True
