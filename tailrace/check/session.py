"""One run against one server: the model, the requests made so far (each made once, shared by
every check that looks at it), and the facts learnt on the way (the probes, whether seed counts)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tailrace.check.client import Client, Exchange
from tailrace.check.expect import ok_json, ok_status
from tailrace.check.probe import Probe, find_probe
from tailrace.check.results import Verdict, ignore
from tailrace.check.wire import PATHS, read_full

SEED = 4242
SEEDED_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Check:
    group: str
    name: str
    rule: str  # one line: what a correct server does
    run: Callable[[Session], None]


class Session:
    def __init__(self, client: Client, model: str) -> None:
        self.client = client
        self.model = model
        self._exchanges: dict[tuple[str, str, bool], Exchange] = {}
        self._probes: dict[str, Probe] = {}
        self._seed_honoured: dict[str, bool] = {}

    def post(self, endpoint: str, body: dict[str, Any], with_key: bool = True) -> Exchange:
        """The exchange for this exact request, made on first use."""
        key = (endpoint, json.dumps(body, sort_keys=True), with_key)
        if key not in self._exchanges:
            self._exchanges[key] = self.client.post(PATHS[endpoint], body, with_key)
        return self._exchanges[key]

    def full(self, endpoint: str, body: dict[str, Any]) -> tuple[Exchange, dict[str, Any]]:
        """A non-stream answer that has to succeed for the check to mean anything."""
        exchange = self.post(endpoint, {**body, "stream": False})
        return exchange, ok_json(exchange)

    def stream(self, endpoint: str, body: dict[str, Any], include_usage: bool = True) -> Exchange:
        streamed = {**body, "stream": True}
        if include_usage:
            streamed["stream_options"] = {**body.get("stream_options", {}), "include_usage": True}
        exchange = self.post(endpoint, streamed)
        ok_status(exchange)
        return exchange

    def streams(self) -> list[tuple[str, Exchange]]:
        """Every successful stream made so far, by endpoint."""
        return [(endpoint, exchange) for (endpoint, _, _), exchange in self._exchanges.items()
                if exchange.streamed and exchange.status == 200]

    def every_stream(self, include_usage: bool = True) -> list[Exchange]:
        """Every stream made so far, after the greedy one of each endpoint served (made now if need
        be): a failure then reproduces with the plainest request."""
        base = []
        for endpoint in ("completions", "chat"):
            try:
                base.append(self.stream(endpoint, self.probe(endpoint).base, include_usage))
            except Verdict:
                pass  # an endpoint not served, or failing: the other groups say so
        return base + [exchange for _, exchange in self.streams() if not any(exchange is b for b in base)]

    def probe(self, endpoint: str) -> Probe:
        if endpoint not in self._probes:
            self._probes[endpoint] = find_probe(self.post, self.model, endpoint)
        return self._probes[endpoint]

    def seeded(self, endpoint: str, **fields: Any) -> dict[str, Any]:
        """A sampled request with a seed; IGNORED where the server does not honour seeds."""
        probe = self.probe(endpoint)
        body = {**probe.base, "temperature": 1.0, "seed": SEED, "max_tokens": SEEDED_MAX_TOKENS, **fields}
        if endpoint not in self._seed_honoured:
            self._seed_honoured[endpoint] = self._honours_seed(endpoint, body)
        if not self._seed_honoured[endpoint]:
            ignore("the server does not honour `seed` (two requests with one seed differ), so sampled "
                   "streams cannot be compared", self.post(endpoint, body))
        return body

    def _honours_seed(self, endpoint: str, body: dict[str, Any]) -> bool:
        """One seed twice gives one text, another seed another (logprobs may move in the last bits)."""
        def texts(exchange: Exchange) -> list[str]:
            return [choice.text for _, choice in sorted(read_full(endpoint, ok_json(exchange)).items())]

        first = texts(self.post(endpoint, body))
        return first == texts(self.client.post(PATHS[endpoint], body)) and \
            first != texts(self.post(endpoint, {**body, "seed": SEED + 1}))

