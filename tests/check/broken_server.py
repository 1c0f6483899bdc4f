"""A small OpenAI-compatible server with a switch per streaming bug, to prove `tailrace check` finds them.

It generates for real, in miniature: a toy vocabulary of byte tokens, some of them halves of
multi-byte characters, drawn by a generator seeded from the prompt (and the request's seed and the
choice's index when sampling), with logprobs made up from the token and its position. Streamed or
not, the same tokens come out, so each injected bug shows on the wire the way it did in real servers.

Mounted under `/bugs/<name>/v1/...`: `none` is the correct server, any name in BUGS injects that one bug.
"""

from __future__ import annotations

import json
import random
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

MODEL = "toy"
API_KEY = "fixture-key"
BUGS = {
    "cumulative": "each chunk carries all the text so far, not the delta",
    "echo_offsets": "streamed text_offset counts the prompt though echo is off",
    "offset_drift": "after the echoed first chunk, streamed text_offset restarts at 0",
    "stop_prefix_leak": "no hold-back: the stream shows the start of a stop string",
    "utf8_split": "each token is decoded alone: U+FFFD where a character spans two tokens",
    "logprobs_ahead": "logprobs go out with each token while its text is held back",
    "no_done": "the stream ends without data: [DONE]",
    "double_usage": "the usage chunk is sent twice",
    "shared_choices": "n>1 choices share one text_offset counter in the stream",
    "shared_sampler": "n>1 choices share one random draw: every choice says the same",
    "error_422": "bad requests get FastAPI's 422 {detail}, not OpenAI's 400 {error}",
    "tool_args_cumulative": "each tool-call piece carries all the arguments so far",
    "tool_name_repeated": "every tool-call piece repeats the call's id and name",
    "tool_finish_stop": "a stream that made a call ends with finish_reason stop",
}
ARGUMENT_PIECE = 5  # characters of a call's arguments per streamed piece
# Words are one to three tokens; the split ones cut a character in two (é, ï, 日本, 😀).
WORDS = [[b" Once"], [b" upon"], [b" a"], [b" time"], [b","], [b"."], [b" the"], [b" sea"], [b" is"], [b" calm"],
         [b" caf", b"\xc3", b"\xa9"], [b" na", b"\xc3\xaf", b"ve"], [b" \xe6\x97", b"\xa5\xe6\x9c\xac"],
         [b" \xf0\x9f\x98", b"\x80"], [b" stre", b"am"], [b" tok", b"ens"], [b" ar", b"rive"]]
SINGLE = [word for word in WORDS if len(word) == 1]
VOCAB = sorted({token for word in WORDS for token in word})


def token_string(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def logprob(raw: bytes, position: int, rank: int = 0) -> float:
    return -round(((VOCAB.index(raw) * 7 + position) % 13 + 1) / 4 + rank, 4)


def generate(key: str, max_tokens: int) -> list[bytes]:
    rng = random.Random(key)
    tokens: list[bytes] = []
    while len(tokens) < max_tokens:
        word = rng.choice(WORDS)
        tokens += word if len(tokens) + len(word) <= max_tokens else rng.choice(SINGLE)
    return tokens


def prompt_pieces(text: str) -> list[str]:
    return re.findall(r"\s*\S+|\s+", text) or [""]


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop string whose first occurrence ends first, and where it starts."""
    found = [(text.find(stop) + len(stop), text.find(stop), stop) for stop in stops if stop and stop in text]
    return min(found)[1:] if found else None


@dataclass
class Answer:
    """One choice, generated and cut at its stop string."""
    tokens: list[bytes]  # the tokens generated, up to the one that completed the stop string
    text: str  # what the client gets (without echo)
    finish_reason: str


def answer(key: str, max_tokens: int, stops: list[str], include_stop: bool) -> Answer:
    tokens = generate(key, max_tokens)
    full = b"".join(tokens).decode()
    found = first_stop(full, stops)
    if found is None:
        return Answer(tokens, full, "length")
    start, stop = found
    end = start + len(stop)
    kept = next(i + 1 for i in range(len(tokens)) if len(b"".join(tokens[:i + 1]).decode(errors="ignore")) >= end)
    return Answer(tokens[:kept], full[:end if include_stop else start], "stop")


@dataclass
class Params:
    endpoint: str
    model: str
    prompt: str  # what seeds generation
    echo: str  # what echo puts in front ("" without echo)
    max_tokens: int
    n: int
    temperature: float
    seed: int | None
    stops: list[str]
    include_stop: bool
    logprobs: int | None
    stream: bool
    include_usage: bool
    call: str | None = None  # chat with tool_choice forcing a call: the function's name

    def key(self, choice: int) -> str:
        if self.temperature == 0:
            return self.prompt
        return f"{self.prompt}|{self.seed}|{choice}" if self.seed is not None else uuid.uuid4().hex


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def parse(endpoint: str, body: dict[str, Any]) -> Params:
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("Missing required parameter: 'messages'.", "messages")
        prompt = "\n".join(str(message.get("content", "")) for message in messages)
        last = messages[-1]
        echo = str(last.get("content", "")) if body.get("echo") and last.get("role") == "assistant" else ""
        top = body.get("top_logprobs") or 0 if body.get("logprobs") else None
    else:
        if not isinstance(body.get("prompt"), str):
            raise BadRequest("Missing required parameter: 'prompt'.", "prompt")
        prompt = body["prompt"]
        echo = prompt if body.get("echo") else ""
        top = body.get("logprobs")
    temperature = body.get("temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise BadRequest(f"Invalid 'temperature': expected a value in [0, 2], got {temperature}.", "temperature")
    stop = body.get("stop") or []
    return Params(endpoint, body.get("model", ""), prompt, echo, body.get("max_tokens") or 16, body.get("n") or 1,
                  temperature, body.get("seed"), [stop] if isinstance(stop, str) else stop,
                  bool(body.get("include_stop_str_in_output")), top, bool(body.get("stream")),
                  bool((body.get("stream_options") or {}).get("include_usage")), forced_call(endpoint, body))


def forced_call(endpoint: str, body: dict[str, Any]) -> str | None:
    """The function a chat request's tool_choice forces ("required": the first tool), if any."""
    choice, tools = body.get("tool_choice"), body.get("tools") or []
    if endpoint != "chat" or not tools:
        return None
    if isinstance(choice, dict):
        return (choice.get("function") or {}).get("name")
    return tools[0]["function"]["name"] if choice == "required" else None


def call_arguments(answer_: Answer) -> str:
    """The forced call's arguments: the answer's words as its one parameter."""
    return json.dumps({"city": answer_.text.strip()}, ensure_ascii=False)


# ---- logprobs ----------------------------------------------------------------------------------------

def completion_logprobs(tokens: list[bytes], positions: range, offsets: list[int], top: int) -> dict[str, Any]:
    return {"tokens": [token_string(t) for t in tokens],
            "token_logprobs": [logprob(t, p) for t, p in zip(tokens, positions)],
            "top_logprobs": [{token_string(VOCAB[(VOCAB.index(t) + r) % len(VOCAB)]): logprob(t, p, r)
                              for r in range(max(top, 1))} for t, p in zip(tokens, positions)],
            "text_offset": offsets}


def chat_logprobs(tokens: list[bytes], positions: range, top: int) -> dict[str, Any]:
    def entry(raw: bytes, position: int, rank: int) -> dict[str, Any]:
        return {"token": token_string(raw), "logprob": logprob(raw, position, rank), "bytes": list(raw)}

    content = [{**entry(t, p, 0), "top_logprobs": [entry(VOCAB[(VOCAB.index(t) + r) % len(VOCAB)], p, r)
                                                   for r in range(top)]} for t, p in zip(tokens, positions)]
    return {"content": content, "refusal": None}


def offsets_of(tokens: list[bytes], start: int, limit: int) -> list[int]:
    """Each token's character offset, clamped to the text the client gets (a stop cuts it)."""
    return [start + min(len(b"".join(tokens[:i]).decode(errors="ignore")), limit) for i in range(len(tokens))]


def echo_logprobs(echo: str, top: int) -> dict[str, Any]:
    pieces = prompt_pieces(echo)
    offsets = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    return {"tokens": pieces, "token_logprobs": [None] + [-1.5] * (len(pieces) - 1),
            "top_logprobs": [None] + [{piece: -1.5} for piece in pieces[1:]], "text_offset": offsets}


def join_completion_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {name: first[name] + second[name] for name in first}


# ---- what a stream sends, step by step -----------------------------------------------------------------

def held_back(text: str, stops: list[str]) -> bool:
    """The text ends with the start of a stop string: it may yet become one."""
    return any(text.endswith(stop[:cut]) for stop in stops for cut in range(1, len(stop)))


def steps(answer_: Answer, stops: list[str], bug: str) -> list[tuple[str, list[int]]]:
    """(text, token positions) per chunk: text and its tokens go out together, once the text is
    whole characters and cannot be the start of a stop string; the last step brings the rest."""
    if bug == "utf8_split":
        return [(token.decode(errors="replace"), [i]) for i, token in enumerate(answer_.tokens)]
    out: list[tuple[str, list[int]]] = []
    sent, pending = "", []
    for i in range(len(answer_.tokens)):
        pending.append(i)
        if i == len(answer_.tokens) - 1:
            out.append((answer_.text[len(sent):], pending))
            break
        try:
            text = b"".join(answer_.tokens[:i + 1]).decode()
        except UnicodeDecodeError:
            continue
        if held_back(text, stops) and bug != "stop_prefix_leak":
            if bug == "logprobs_ahead":
                out.append(("", pending))
                pending = []
            continue
        out.append((text[len(sent):], pending))
        sent, pending = text, []
    return out


@dataclass
class ChoiceStream:
    index: int
    answer: Answer
    steps: list[tuple[str, list[int]]]
    offsets: list[int] = field(default_factory=list)  # completions: each generated token's text_offset


def envelope(params: Params, request_id: str, created: int) -> dict[str, Any]:
    kind = "text_completion" if params.endpoint == "completions" else "chat.completion.chunk"
    return {"id": request_id, "object": kind, "created": created, "model": params.model}


def call_events(params: Params, answers: list[Answer], bug: str) -> Iterator[str]:
    """A forced call, streamed: its id and name on the first piece, then its arguments in pieces."""
    head = envelope(params, f"cmpl-{uuid.uuid4().hex}", int(time.time()))
    call_id = f"call_{uuid.uuid4().hex[:24]}"
    named = {"id": call_id, "type": "function"}

    def event(delta: dict[str, Any], finish: str | None = None) -> str:
        part = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return "data: " + json.dumps({**head, "choices": [part]}) + "\n\n"

    yield event({"role": "assistant", "tool_calls": [{"index": 0, **named, "function": {"name": params.call,
                                                                                         "arguments": ""}}]})
    arguments = call_arguments(answers[0])
    for end in range(ARGUMENT_PIECE, len(arguments) + ARGUMENT_PIECE, ARGUMENT_PIECE):
        piece = arguments[:end] if bug == "tool_args_cumulative" else arguments[end - ARGUMENT_PIECE:end]
        extra = {**named, "function": {"name": params.call, "arguments": piece}} if bug == "tool_name_repeated" \
            else {"function": {"arguments": piece}}
        yield event({"tool_calls": [{"index": 0, **extra}]})
    yield event({}, "stop" if bug == "tool_finish_stop" else "tool_calls")
    if params.include_usage:
        yield "data: " + json.dumps({**head, "choices": [], "usage": usage(params, answers)}) + "\n\n"
    yield "data: [DONE]\n\n"


def stream_events(params: Params, answers: list[Answer], bug: str) -> Iterator[str]:
    if params.call is not None:
        yield from call_events(params, answers, bug)
        return
    request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    choices = [ChoiceStream(k, a, steps(a, params.stops, bug)) for k, a in enumerate(answers)]
    shared = 0
    for choice in choices:
        base = len(params.echo)
        if bug == "echo_offsets" and not params.echo:
            base = len(params.prompt)
        if bug == "offset_drift" and params.echo:
            base = 0
        if bug == "shared_choices":
            base += shared
            shared += len(choice.answer.text)
        choice.offsets = offsets_of(choice.answer.tokens, base, len(choice.answer.text))

    def chunk(choice: ChoiceStream, text: str, positions: list[int], finish: str | None,
              first: bool = False) -> str:
        tokens = [choice.answer.tokens[p] for p in positions]
        part: dict[str, Any] = {"index": choice.index, "logprobs": None, "finish_reason": finish}
        if params.endpoint == "completions":
            if params.logprobs is not None and finish is None:
                lp = completion_logprobs(tokens, positions, [choice.offsets[p] for p in positions], params.logprobs)
                part["logprobs"] = join_completion_logprobs(echo_logprobs(params.echo, params.logprobs), lp) \
                    if first and params.echo else lp
            part["text"] = text
        else:
            if params.logprobs is not None and finish is None:
                part["logprobs"] = chat_logprobs(tokens, positions, params.logprobs)
            part["delta"] = {} if finish else {"role": "assistant", "content": text} if first else {"content": text}
        return "data: " + json.dumps({**envelope(params, request_id, created), "choices": [part]}) + "\n\n"

    sent = {choice.index: "" for choice in choices}
    for number in range(max(len(choice.steps) for choice in choices)):
        for choice in choices:
            if number < len(choice.steps):
                text, positions = choice.steps[number]
                if number == 0:
                    text = params.echo + text
                sent[choice.index] += text
                yield chunk(choice, sent[choice.index] if bug == "cumulative" else text, positions, None,
                            first=number == 0)
    for choice in choices:
        yield chunk(choice, "", [], choice.answer.finish_reason)
    if params.include_usage:
        usage_event = "data: " + json.dumps({**envelope(params, request_id, created), "choices": [],
                                              "usage": usage(params, answers)}) + "\n\n"
        yield usage_event
        if bug == "double_usage":
            yield usage_event
    if bug != "no_done":
        yield "data: [DONE]\n\n"


# ---- whole answers -----------------------------------------------------------------------------------------

def usage(params: Params, answers: list[Answer]) -> dict[str, int]:
    prompt_tokens = len(prompt_pieces(params.prompt))
    completion_tokens = sum(len(a.tokens) for a in answers)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_choice(params: Params, index: int, answer_: Answer) -> dict[str, Any]:
    positions = range(len(answer_.tokens))
    if params.endpoint == "completions":
        logprobs = None
        if params.logprobs is not None:
            offsets = offsets_of(answer_.tokens, len(params.echo), len(answer_.text))
            logprobs = completion_logprobs(answer_.tokens, positions, offsets, params.logprobs)
            if params.echo:
                logprobs = join_completion_logprobs(echo_logprobs(params.echo, params.logprobs), logprobs)
        return {"index": index, "text": params.echo + answer_.text, "logprobs": logprobs,
                "finish_reason": answer_.finish_reason}
    if params.call is not None:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": params.call, "arguments": call_arguments(answer_)}}
        return {"index": index, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                "logprobs": None, "finish_reason": "tool_calls"}
    logprobs = None if params.logprobs is None else chat_logprobs(answer_.tokens, positions, params.logprobs)
    return {"index": index, "message": {"role": "assistant", "content": params.echo + answer_.text},
            "logprobs": logprobs, "finish_reason": answer_.finish_reason}


def full_response(params: Params, answers: list[Answer]) -> dict[str, Any]:
    kind = "text_completion" if params.endpoint == "completions" else "chat.completion"
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": params.model,
            "choices": [full_choice(params, k, a) for k, a in enumerate(answers)], "usage": usage(params, answers)}


# ---- HTTP ---------------------------------------------------------------------------------------------------

def error(status: int, message: str, kind: str, param: str | None, code: str | None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def build_app() -> FastAPI:
    app = FastAPI()

    @app.get("/bugs/{bug}/v1/models")
    def models(bug: str) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "fixture"}]}

    async def serve(endpoint: str, bug: str, request: Request) -> Response:
        if bug != "none" and bug not in BUGS:
            return error(404, f"no bug {bug}", "invalid_request_error", None, None)
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return error(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")
        body = await request.json()
        try:
            params = parse(endpoint, body)
        except BadRequest as exc:
            if bug == "error_422":
                return JSONResponse({"detail": [{"loc": ["body", exc.param], "msg": str(exc)}]}, 422)
            return error(400, str(exc), "invalid_request_error", exc.param, "invalid_value")
        if params.model != MODEL:
            return error(404, f"The model `{params.model}` does not exist.", "invalid_request_error", "model",
                         "model_not_found")
        draws = [0] * params.n if bug == "shared_sampler" else range(params.n)
        answers = [answer(params.key(k), params.max_tokens, params.stops, params.include_stop) for k in draws]
        if params.stream:
            return StreamingResponse(stream_events(params, answers, bug), media_type="text/event-stream")
        return JSONResponse(full_response(params, answers))

    @app.post("/bugs/{bug}/v1/completions")
    async def completions(bug: str, request: Request) -> Response:
        return await serve("completions", bug, request)

    @app.post("/bugs/{bug}/v1/chat/completions")
    async def chat(bug: str, request: Request) -> Response:
        return await serve("chat", bug, request)

    return app
