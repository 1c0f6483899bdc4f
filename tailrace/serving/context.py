"""What the API layer hands the serving layer with each request."""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.metrics import ServerMetrics


@dataclass(slots=True)
class RequestContext:
    # Unique per HTTP request (a fresh `req-<hex>` even when the client sent its own x-request-id,
    # which may repeat), so it is safe to build engine request ids from it.
    request_id: str
    model_name: str  # the served model name, echoed as `model` in responses
    metrics: ServerMetrics
