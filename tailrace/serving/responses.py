"""POST /v1/responses (OpenAI Responses): a chat answer framed as output items (reasoning,
message, function calls) and OpenAI's typed stream events; stored responses continue with
`previous_response_id` and run in the background with `background: true`."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel

from tailrace.engine.client import EngineClient
from tailrace.serving.chat_deltas import Delta, RunningUsage, chat_deltas, drain, framed
from tailrace.serving.context import RequestContext
from tailrace.serving.errors import OpenAIError, internal, invalid_request
from tailrace.serving.protocol_responses import Item, ResponsesRequest
from tailrace.serving.responses_store import ResponseStore, StoredResponse

logger = logging.getLogger(__name__)


async def create_response(engine: EngineClient, request: ResponsesRequest, ctx: RequestContext,
                          store: ResponseStore, sampling_defaults: dict[str, float]
                          ) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """Validate and start now (errors raise OpenAIError); then the response, or its stream events.
    A background response is returned queued while it runs on."""
    if request.background and (request.stream or not request.store):
        raise invalid_request("background=true needs store=true and stream=false on this server.",
                              param="background")
    history = store.get(request.previous_response_id, "previous_response_id").history() \
        if request.previous_response_id else []
    conversation = history + [item.model_dump(exclude_none=True) for item in request.input_items()]
    chat = request.chat_request([Item.model_validate(item) for item in conversation])
    run = await chat_deltas(engine, chat, ctx, sampling_defaults)
    framer = ResponseFramer(response_object(request, ctx, run.request.temperature, run.request.top_p), run.usage)
    events = framed(run, framer, request.stream)
    if request.background:
        entry = StoredResponse(framer.response, conversation)
        framer.response["status"] = "queued"
        entry.task = asyncio.create_task(_run_in_background(events, framer, store, entry))
        store.put(entry)
        return copy.deepcopy(framer.response)
    if request.store:
        events = _stored(events, store, StoredResponse(framer.response, conversation))
    if request.stream:
        return events
    await drain(events)
    return framer.response


def response_object(request: ResponsesRequest, ctx: RequestContext, temperature: float, top_p: float
                    ) -> dict[str, Any]:
    """The response as created: what the request asked for, echoed, and no output yet."""
    text_format = request.text.format if request.text is not None and request.text.format is not None else None
    return {
        "id": f"resp_{ctx.request_id.removeprefix('req-')}", "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "background": request.background, "error": None, "incomplete_details": None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "model": ctx.model_name, "output": [], "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "store": request.store, "temperature": temperature,
        "text": {"format": _echoed(text_format) or {"type": "text"}},
        "tool_choice": _echoed(request.tool_choice) or "auto",
        "tools": [_echoed(tool) for tool in request.tools or []],
        "top_logprobs": request.top_logprobs, "top_p": top_p, "truncation": "disabled", "usage": None,
        "user": request.user, "metadata": request.metadata or {},
    }


def _echoed(value: Any) -> Any:
    """A request field as the response repeats it."""
    return value.model_dump(by_alias=True, exclude_none=True) if isinstance(value, BaseModel) else value


async def _stored(events: AsyncIterator[dict[str, Any]], store: ResponseStore,
                  entry: StoredResponse) -> AsyncIterator[dict[str, Any]]:
    """The events unchanged; the response is stored once they have all gone out."""
    async with aclosing(events) as running:
        async for event in running:
            yield event
    store.put(entry)


async def _run_in_background(events: AsyncIterator[dict[str, Any]], framer: ResponseFramer, store: ResponseStore,
                             entry: StoredResponse) -> None:
    try:
        await drain(events)
    except asyncio.CancelledError:
        framer.response["status"] = "cancelled"
    except OpenAIError as err:
        framer.fail(err)
    except Exception:
        logger.exception("background response %s failed", entry.response["id"])
        framer.fail(internal())
    store.remeasure(entry)


class ResponseFramer:
    """Deltas in, OpenAI's Responses stream events out. `response` is what the events build: the
    non-stream response is exactly the one `response.completed` carries."""

    def __init__(self, response: dict[str, Any], usage: RunningUsage) -> None:
        self.response = response
        self._usage = usage
        self._sequence = 0
        self._open: str | None = None  # the type of the last output item while it is open
        self._logprobs: list[dict[str, Any]] = []  # of text not yet sent (held back, or in no message yet)

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        events = [] if self._sequence else self._start()
        if delta.reasoning:
            self._logprobs = []  # tokens before thinking text are thinking (its open tag)
            events += self._reasoning(delta.reasoning)
        if not (delta.reasoning or delta.calls):  # logprobs belong to output text only
            self._logprobs += delta.logprobs
        if delta.content:
            events += self._text(delta.content)
        for call in delta.calls:
            events += self._call(call.id, call.name, call.arguments)
        if delta.finish_reason is not None:
            events += self._end(delta.finish_reason)
        return events

    def finish(self) -> list[dict[str, Any]]:
        return []  # the finishing delta ended the response

    def fail(self, error: OpenAIError) -> list[dict[str, Any]]:
        self.response.update(status="failed", error={"code": error.code or "server_error", "message": error.message})
        return [self._event("response.failed", response=copy.deepcopy(self.response))]

    # ---- events --------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _item_id(self, prefix: str) -> str:
        """Unique because the response id is; the same in a stream and its non-stream twin."""
        return f"{prefix}_{self.response['id'].removeprefix('resp_')}_{len(self.response['output'])}"

    def _item_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event about the last output item, naming it by index and id."""
        index = len(self.response["output"]) - 1
        return self._event(kind, output_index=index, item_id=self.response["output"][index]["id"], **fields)

    def _start(self) -> list[dict[str, Any]]:
        self.response["status"] = "in_progress"
        return [self._event("response.created", response=copy.deepcopy(self.response)),
                self._event("response.in_progress", response=copy.deepcopy(self.response))]

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open != "reasoning":
            events = self._open_item({"id": self._item_id("rs"), "type": "reasoning", "summary": [],
                                      "content": [], "status": "in_progress"},
                                     {"type": "reasoning_text", "text": ""})
        self.response["output"][-1]["content"][0]["text"] += text
        events.append(self._item_event("response.reasoning_text.delta", content_index=0, delta=text))
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open != "message":
            events = self._open_item({"id": self._item_id("msg"), "type": "message", "status": "in_progress",
                                      "role": "assistant", "content": []},
                                     {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        part = self.response["output"][-1]["content"][0]
        part["text"] += text
        logprobs, self._logprobs = self._logprobs, []
        part["logprobs"] += logprobs
        events.append(self._item_event("response.output_text.delta", content_index=0, delta=text, logprobs=logprobs))
        return events

    def _call(self, call_id: str | None, name: str | None, arguments: str) -> list[dict[str, Any]]:
        events = []
        if call_id is not None:
            events = self._open_item({"id": self._item_id("fc"), "type": "function_call",
                                      "status": "in_progress", "call_id": call_id, "name": name, "arguments": ""})
        if arguments:
            self.response["output"][-1]["arguments"] += arguments
            events.append(self._item_event("response.function_call_arguments.delta", delta=arguments))
        return events

    def _open_item(self, item: dict[str, Any], part: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Close the open item and start `item`, with `part` as its first content part."""
        events = self._close_item("completed")
        self.response["output"].append(item)
        self._open = item["type"]
        events.append(self._item_event("response.output_item.added", item=copy.deepcopy(item)))
        if part is not None:
            item["content"].append(part)
            events.append(self._item_event("response.content_part.added", content_index=0, part=copy.deepcopy(part)))
        return events

    def _close_item(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        item = self.response["output"][-1]
        self._open = None
        item["status"] = status
        events = []
        if item["type"] == "function_call":
            events.append(self._item_event("response.function_call_arguments.done", name=item["name"],
                                           arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": part["logprobs"]} if kind == "output_text" else {}
            events.append(self._item_event(f"response.{kind}.done", content_index=0, text=part["text"], **extra))
            events.append(self._item_event("response.content_part.done", content_index=0, part=copy.deepcopy(part)))
        events.append(self._item_event("response.output_item.done", item=copy.deepcopy(item)))
        return events

    def _end(self, finish_reason: str) -> list[dict[str, Any]]:
        cut = finish_reason == "length"
        events = self._close_item("incomplete" if cut else "completed")
        usage = self._usage
        self.response["usage"] = {
            "input_tokens": usage.input_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.output_tokens, "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.input_tokens + usage.output_tokens}
        if cut:
            self.response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        else:
            self.response["status"] = "completed"
        events.append(self._event(f"response.{self.response['status']}", response=copy.deepcopy(self.response)))
        return events
