"""What the API layer hands the serving layer with each request."""

from __future__ import annotations

from dataclasses import dataclass, field

from tailrace.metrics import ServerMetrics
from tailrace.serving.limits import Admission, Limits


@dataclass(slots=True, frozen=True)
class ChatOptions:
    """How chat answers are read, fixed for the server by its flags."""

    # A format of parsers/choice.TOOL_PARSERS, "none" (the drifted forms only) or "auto" (the chat
    # template's format); tailrace serve decides "auto" at start-up (choice.resolve_formats).
    tool_call_parser: str = "auto"
    reasoning_parser: str | None = "auto"  # "think": <think>...</think> off the answer; None: off
    reasoning_field: str = "reasoning_content"  # or "reasoning" (vLLM's and Ollama's name)
    # What the chat template takes of tool calls (template_fit.fit_to_template decides it at start-up):
    parallel_calls: bool = True  # several calls in one assistant turn
    call_id_length: int | None = None  # call ids cut to their last N letters and digits; None: as issued


@dataclass(slots=True)
class RequestContext:
    # Unique per HTTP request (a fresh `req-<hex>` even when the client sent its own x-request-id,
    # which may repeat), so it is safe to build engine request ids from it.
    request_id: str
    model_name: str  # the served model name, echoed as `model` in responses
    metrics: ServerMetrics
    limits: Limits = field(default_factory=Limits)
    admission: Admission | None = None  # None: no queue bound (unit tests)
    chat: ChatOptions = field(default_factory=ChatOptions)
