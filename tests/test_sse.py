"""SSE framing: one-line data events, DONE, in-band errors."""

import asyncio

import orjson

from tailrace.api.sse import DONE, encode_event, error_event, sse_stream
from tailrace.serving.errors import OpenAIError, invalid_request


def collect(chunks) -> list[bytes]:
    async def run():
        return [frame async for frame in sse_stream(chunks)]
    return asyncio.run(run())


async def from_list(items, fail_with: Exception | None = None):
    for item in items:
        yield item
    if fail_with is not None:
        raise fail_with


def test_event_is_data_line_with_compact_json_and_blank_line():
    assert encode_event({"a": [1, 2], "b": "x"}) == b'data: {"a":[1,2],"b":"x"}\n\n'


def test_newlines_inside_strings_stay_on_one_line():
    frame = encode_event({"text": "line1\nline2"})
    assert frame.count(b"\n") == 2 and frame.endswith(b"\n\n")


def test_done_is_exact():
    assert DONE == b"data: [DONE]\n\n"


def test_error_event_carries_the_openai_body():
    frame = error_event(invalid_request("bad", param="n"))
    assert orjson.loads(frame.removeprefix(b"data: "))["error"]["param"] == "n"


def test_stream_frames_each_chunk_then_done():
    assert collect(from_list([{"i": 0}, {"i": 1}])) == [b'data: {"i":0}\n\n', b'data: {"i":1}\n\n', DONE]


def test_empty_stream_is_just_done():
    assert collect(from_list([])) == [DONE]


def test_openai_error_mid_stream_becomes_its_body_then_done():
    frames = collect(from_list([{"i": 0}], OpenAIError(400, "too long", code="context_length_exceeded")))
    assert orjson.loads(frames[1].removeprefix(b"data: "))["error"]["code"] == "context_length_exceeded"
    assert frames[2] == DONE


def test_unexpected_error_mid_stream_is_a_generic_server_error_without_details():
    frames = collect(from_list([], RuntimeError("secret /path/to/file.py")))
    error = orjson.loads(frames[0].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error" and "secret" not in frames[0].decode()
    assert frames[1] == DONE


def test_frames_have_no_event_or_id_lines():
    frames = collect(from_list([{"i": 0}], RuntimeError("x")))
    assert all(line.startswith(b"data: ") for frame in frames for line in frame.split(b"\n") if line)


def test_closing_the_stream_early_closes_the_source():
    closed = []

    async def source():
        try:
            for i in range(10):
                yield {"i": i}
        finally:
            closed.append(True)

    async def run():
        stream = sse_stream(source())
        await anext(stream)
        await stream.aclose()

    asyncio.run(run())
    assert closed == [True]
