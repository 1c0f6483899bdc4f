"""The black-box client: one HTTP exchange recorded whole (status, headers, the raw reads as they
arrived), its SSE events decoded leniently, and the curl command line that repeats it."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import httpx

from tailrace.bench.sse import decode_lines

DONE = "[DONE]"
LINE_END = re.compile(r"\r\n|\r|\n")
KEY_VARIABLE = "OPENAI_API_KEY"  # reproducers name the key, so reports never hold it


@dataclass(slots=True)
class Exchange:
    path: str
    body: dict[str, Any]
    status: int = 0
    content_type: str = ""
    with_key: bool = True
    reads: list[bytes] = field(default_factory=list)  # the body as the transport handed it over
    transport_error: str = ""

    @property
    def raw(self) -> bytes:
        return b"".join(self.reads)

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))

    def json(self) -> Any:
        """The parsed body; None when it is not JSON."""
        try:
            return json.loads(self.raw)
        except ValueError:
            return None

    def events(self) -> list[str]:
        """Every event's data, lenient about framing (the framing checks are strict on their own)."""
        # SSE's line endings only: str.splitlines would also cut at U+2028 inside a JSON string
        return decode_lines(LINE_END.split(self.raw.decode("utf-8", errors="replace")))

    def chunks(self) -> list[dict[str, Any]]:
        """The JSON objects before [DONE]; events that are not JSON objects are left out."""
        chunks = []
        for data in self.events():
            if data == DONE:
                break
            try:
                value = json.loads(data)
            except ValueError:
                continue
            if isinstance(value, dict):
                chunks.append(value)
        return chunks


class Client:
    """POSTs and GETs against one base URL (`.../v1`), recording each exchange."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self._http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def headers(self, with_key: bool = True) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if with_key and self.api_key else {}

    def post(self, path: str, body: dict[str, Any], with_key: bool = True) -> Exchange:
        exchange = self._post_once(path, body, with_key)
        if exchange.transport_error and not exchange.status:
            # A kept-alive connection the server closed (after a 500, say) fails the next request
            # before it is sent; a fresh connection tells that apart from a server that is down.
            exchange = self._post_once(path, body, with_key)
        return exchange

    def _post_once(self, path: str, body: dict[str, Any], with_key: bool) -> Exchange:
        exchange = Exchange(path, body, with_key=with_key)
        # identity: the framing checks read the bytes as sent, which compression would hide
        headers = {"Accept-Encoding": "identity", **self.headers(with_key)}
        try:
            with self._http.stream("POST", self.base_url + path, json=body, headers=headers) as reply:
                exchange.status = reply.status_code
                exchange.content_type = reply.headers.get("content-type", "")
                exchange.reads.extend(reply.iter_raw())
        except httpx.HTTPError as exc:
            exchange.transport_error = f"{type(exc).__name__}: {exc}"
        return exchange

    def get_json(self, path: str) -> Any:
        reply = self._http.get(self.base_url + path, headers=self.headers())
        reply.raise_for_status()
        return reply.json()

    def curl(self, exchange: Exchange) -> str:
        """The exact request as a curl command line."""
        parts = ["curl", "-sN", shlex.quote(self.base_url + exchange.path), "-H", "'Content-Type: application/json'"]
        if self.api_key and exchange.with_key:
            parts += ["-H", f'"Authorization: Bearer ${KEY_VARIABLE}"']
        parts += ["-d", shlex.quote(json.dumps(exchange.body, ensure_ascii=False, separators=(",", ":")))]
        return " ".join(parts)
