"""The recorded exchange: its events read leniently, and the curl command that repeats it."""

from __future__ import annotations

import json
import shlex

from tailrace.check.client import Client, Exchange


def test_a_line_separator_inside_json_does_not_cut_the_event():
    body = 'data: {"t": "a\u2028b"}\n\ndata: [DONE]\n\n'.encode()
    exchange = Exchange("/completions", {"stream": True}, reads=[body])
    assert exchange.chunks() == [{"t": "a\u2028b"}]


def test_the_reproducer_posts_the_exact_body():
    body = {"model": "m", "prompt": "it's \u00e9", "stream": True}
    command = shlex.split(Client("http://x/v1", None, 1.0).curl(Exchange("/completions", body)))
    assert json.loads(command[command.index("-d") + 1]) == body


def test_the_reproducer_names_the_key_but_never_holds_it():
    command = Client("http://x/v1", "secret", 1.0).curl(Exchange("/completions", {}))
    assert "secret" not in command and "$OPENAI_API_KEY" in command


def test_a_request_made_without_the_key_is_reproduced_without_it():
    command = Client("http://x/v1", "secret", 1.0).curl(Exchange("/completions", {}, with_key=False))
    assert "Authorization" not in command
