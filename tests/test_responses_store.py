"""The in-memory response store: capped in count and bytes, least recently used evicted first, and
an evicted id reads like one that never existed."""

from __future__ import annotations

import asyncio

import pytest

from tailrace.serving.errors import OpenAIError
from tailrace.serving.responses_store import ResponseStore, StoredResponse, StoreLimits


def entry(response_id: str, text: str = "") -> StoredResponse:
    return StoredResponse({"id": response_id, "output": [{"type": "message", "text": text}]},
                          [{"role": "user", "content": "hi"}])


def test_a_stored_response_is_found_by_id():
    store = ResponseStore()
    store.put(entry("resp_a"))
    assert store.get("resp_a").response["id"] == "resp_a"


def test_history_is_the_conversation_then_the_output():
    stored = entry("resp_a", "Sunny.")
    assert stored.history() == [{"role": "user", "content": "hi"}, {"type": "message", "text": "Sunny."}]


def test_over_the_count_cap_the_least_recently_used_goes():
    store = ResponseStore(StoreLimits(max_count=2))
    store.put(entry("resp_a"))
    store.put(entry("resp_b"))
    store.get("resp_a")  # now b is the least recently used
    store.put(entry("resp_c"))
    assert {"resp_a", "resp_c"} == {e for e in ("resp_a", "resp_b", "resp_c") if _has(store, e)}


def test_over_the_byte_cap_old_responses_go():
    store = ResponseStore(StoreLimits(max_bytes=300))
    store.put(entry("resp_a", "x" * 100))
    store.put(entry("resp_b", "y" * 100))
    assert not _has(store, "resp_a") and _has(store, "resp_b")


def test_an_unknown_or_evicted_id_is_a_404():
    with pytest.raises(OpenAIError) as caught:
        ResponseStore().get("resp_nope")
    assert caught.value.status == 404 and "resp_nope" in caught.value.message


def test_delete_removes_and_a_second_delete_is_a_404():
    store = ResponseStore()
    store.put(entry("resp_a"))
    store.delete("resp_a")
    with pytest.raises(OpenAIError):
        store.delete("resp_a")


def test_only_background_responses_can_be_cancelled():
    store = ResponseStore()
    store.put(entry("resp_a"))
    with pytest.raises(OpenAIError) as caught:
        store.cancel("resp_a")
    assert caught.value.status == 400


def test_cancelling_a_running_background_response_stops_it():
    async def go():
        store = ResponseStore()
        running = entry("resp_a")
        running.task = asyncio.create_task(asyncio.sleep(60))
        store.put(running)
        response = store.cancel("resp_a")
        await asyncio.gather(running.task, return_exceptions=True)
        return response, running.task
    response, task = asyncio.run(go())
    assert response["status"] == "cancelled" and task.cancelled()


def _has(store: ResponseStore, response_id: str) -> bool:
    try:
        store.get(response_id)
    except OpenAIError:
        return False
    return True


def test_a_deleted_background_response_stays_deleted_when_it_finishes():
    store = ResponseStore()
    running = entry("resp_a")
    store.put(running)
    store.delete("resp_a")
    store.remeasure(running)
    assert not _has(store, "resp_a")
