"""What a client rebuilds from a Responses stream's events alone, checking OpenAI's event rules on
the way; shared by the unit tests and the e2e matrix."""

from __future__ import annotations

import json


def reassembled(events: list[dict]) -> dict:
    """The response a client rebuilds from the deltas alone, checking the event rules on the way."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    response = json.loads(json.dumps(events[0]["response"]))
    for event in events[2:-1]:
        if event["type"] == "response.output_item.added":
            assert event["output_index"] == len(response["output"])
            response["output"].append(event["item"])
            continue
        item = response["output"][event["output_index"]]
        assert event["item_id"] == item["id"]
        if event["type"] == "response.content_part.added":
            item["content"].append(event["part"])
        elif event["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            part = item["content"][event["content_index"]]
            part["text"] += event["delta"]
            part.setdefault("logprobs", []).extend(event.get("logprobs", []))
            if "logprobs" not in event:
                del part["logprobs"]
        elif event["type"] == "response.function_call_arguments.delta":
            item["arguments"] += event["delta"]
        elif event["type"] == "response.output_item.done":
            assert {**item, "status": event["item"]["status"]} == event["item"]
            item["status"] = event["item"]["status"]
    final = events[-1]["response"]
    response.update({k: v for k, v in final.items() if k != "output"})
    assert response == final
    return final
