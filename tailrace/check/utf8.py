"""UTF-8: a character split across tokens reaches a stream whole, never as U+FFFD."""

from __future__ import annotations

from typing import Any

from tailrace.check.compare import first_difference
from tailrace.check.probe import MAX_TOKENS
from tailrace.check.results import fail, skip
from tailrace.check.session import Check, Session
from tailrace.check.wire import read_full, read_stream

GROUP = "utf8"
REPLACEMENT = "\ufffd"
PROMPTS = ("Café crème, naïve résumé, déjà vu, 日本語のテキスト:", "Emoji: 😀 🎉 👍 🚀",
           "Translate into Japanese: good morning =", "Ünïcödé: ä ö ü ß → ≤ ≥ ∞ ±")


def _request(endpoint: str, model: str, prompt: str) -> dict[str, Any]:
    text = {"prompt": prompt} if endpoint == "completions" else {"messages": [{"role": "user", "content": prompt}]}
    return {"model": model, **text, "max_tokens": MAX_TOKENS, "temperature": 0}


def _multibyte(endpoint: str):
    def run(session: Session) -> None:
        session.probe(endpoint)  # skips an endpoint that is not served
        for prompt in PROMPTS:
            body = _request(endpoint, session.model, prompt)
            _, full = session.full(endpoint, body)
            text = read_full(endpoint, full)[0].text
            if text.isascii() or REPLACEMENT in text:
                continue
            stream = session.stream(endpoint, body)
            streamed = read_stream(endpoint, stream.chunks())[0].text
            if REPLACEMENT in streamed:
                fail(f"U+FFFD in the stream at character {streamed.index(REPLACEMENT)}, none in the non-stream "
                     f"text: {streamed[:80]!r}", stream)
            reason = first_difference(streamed, text)
            if reason is not None:
                fail(reason, stream)
            return
        skip(f"the model wrote no multi-byte character (without U+FFFD) for any of {len(PROMPTS)} prompts")
    return run


CHECKS = [Check(GROUP, f"{endpoint} multi-byte text", "no U+FFFD in a stream whose non-stream text has none; "
                "the stream joins to the same characters", _multibyte(endpoint))
          for endpoint in ("completions", "chat")]
