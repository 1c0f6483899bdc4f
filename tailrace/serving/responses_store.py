"""Stored responses (`store: true`): what GET /v1/responses/{id} answers and what a later request
continues with `previous_response_id`. In memory, capped in count and bytes, least recently used
evicted first; an evicted id reads exactly like one that never existed."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from tailrace.serving.errors import OpenAIError, invalid_request


@dataclass(slots=True)
class StoreLimits:
    max_count: int = 1000
    max_bytes: int = 256 * 1024 * 1024


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the live object: a background response fills it in as it runs
    conversation: list[dict[str, Any]]  # the input items of the whole chain, this request's last
    size: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)  # a background response's run

    def history(self) -> list[dict[str, Any]]:
        """What a request continuing this response sees before its own input."""
        return self.conversation + self.response["output"]


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param=param, code="not_found")


class ResponseStore:
    def __init__(self, limits: StoreLimits | None = None) -> None:
        self.limits = limits or StoreLimits()
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        # asyncio keeps only weak references to tasks: a background run must outlive its entry's eviction.
        self._running: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        """Store (or re-store, once finished) a response; the least recently used go when over a cap.
        One larger than the byte cap alone is not kept."""
        response_id = entry.response["id"]
        self._drop(response_id)
        if entry.task is not None and not entry.task.done():
            self._running.add(entry.task)
            entry.task.add_done_callback(self._running.discard)
        entry.size = len(orjson.dumps(entry.response)) + len(orjson.dumps(entry.conversation))
        self._entries[response_id] = entry
        self._bytes += entry.size
        while self._entries and (len(self._entries) > self.limits.max_count or self._bytes > self.limits.max_bytes):
            self._drop(next(iter(self._entries)))

    def remeasure(self, entry: StoredResponse) -> None:
        """Count a finished background response at its final size, if it is still stored (a
        deleted or evicted one stays gone)."""
        if self._entries.get(entry.response["id"]) is entry:
            self.put(entry)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise not_found(response_id, param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        if response_id not in self._entries:
            raise not_found(response_id)
        self._drop(response_id)

    def cancel(self, response_id: str) -> dict[str, Any]:
        """Stop a background response that is still running; a finished one is returned as it is."""
        entry = self.get(response_id)
        if entry.task is None:
            raise invalid_request("Only a response created with background=true can be cancelled.",
                                  param="response_id")
        if not entry.task.done():
            entry.task.cancel()
            entry.response["status"] = "cancelled"
        return entry.response

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
