"""One request's measurements, and how an OpenAI stream's events fill them in.

Timing follows `vllm bench serve`: TTFT is the arrival of the first chunk with content; each later
content chunk adds one inter-token latency, the gap since the previous content chunk. A chunk that
carries k > 1 tokens still adds one gap (the stream does not say how the k tokens were spaced), so
ITL stays a per-chunk figure while TPOT, normalised by the token count, stays per-token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

DONE = "[DONE]"


@dataclass(slots=True)
class RequestRecord:
    index: int
    prompt_tokens: int  # the server's usage count once the stream ends; until then our estimate
    sent: float = 0.0  # s after the level started
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # s from sending to the first content chunk
    itl: list[float] = field(default_factory=list)  # s between consecutive content chunks
    e2e: float = 0.0  # s from sending to the end of the stream
    output_tokens: int = 0  # usage.completion_tokens, else the number of content chunks
    content_chunks: int = 0
    text: str = ""  # the answer, joined: what servers that must agree are compared on


def chunk_text(choice: dict[str, Any]) -> str:
    """The generated text in one streamed choice: completions put it in `text`, chat in `delta`."""
    if text := choice.get("text"):
        return text
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or ""


def error_message(error: Any) -> str:
    """OpenAI sends `{"error": {"message": ...}}`; some servers send the message as a bare string."""
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


class StreamRecorder:
    """Turns (event data, arrival time) pairs into a `RequestRecord`; times are `perf_counter` s."""

    __slots__ = ("record", "_started", "_last_content", "_usage_tokens", "_over")

    def __init__(self, record: RequestRecord, started: float) -> None:
        self.record = record
        self._started = started
        self._last_content = 0.0
        self._usage_tokens: int | None = None
        self._over = False

    def on_event(self, data: str, now: float) -> bool:
        """Take one event; False once the stream is over ([DONE], an error, or garbage): later
        events are ignored."""
        if self._over or data == DONE:
            self._over = True
            return False
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return self.fail(f"undecodable event: {data[:200]}")
        if not isinstance(chunk, dict):
            return self.fail(f"unexpected event: {data[:200]}")
        if chunk.get("error") is not None:
            return self.fail(error_message(chunk["error"]))
        choices = chunk.get("choices") or ()
        if choices and (text := chunk_text(choices[0])):
            self._on_content(now)
            self.record.text += text
        if usage := chunk.get("usage"):
            self._usage_tokens = usage.get("completion_tokens")
            self.record.prompt_tokens = usage.get("prompt_tokens") or self.record.prompt_tokens
        return True

    def _on_content(self, now: float) -> None:
        record = self.record
        if record.content_chunks == 0:
            record.ttft = now - self._started
        else:
            record.itl.append(now - self._last_content)
        record.content_chunks += 1
        self._last_content = now

    def fail(self, message: str) -> bool:
        if not self.record.error:
            self.record.error = message
        self._over = True
        return False

    def finish(self, now: float) -> RequestRecord:
        record = self.record
        record.e2e = now - self._started
        record.output_tokens = self._usage_tokens if self._usage_tokens is not None else record.content_chunks
        if not record.error and record.content_chunks == 0:
            record.error = "the stream ended without content"
        record.ok = not record.error
        return record


@dataclass(slots=True)
class LevelResult:
    """One concurrency level: every request's record and the wall time the level took."""

    concurrency: int
    request_rate: float  # requests/s of the Poisson arrivals; inf: all at once
    duration: float  # s from the first send to the last stream's end
    records: list[RequestRecord]
