"""The tokenizer wrapper: loading an HF directory, encode/decode, per-token text and bytes, and
the chat template rendered as transformers renders it."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import processors

from tailrace.tokenizer import Tokenizer, load_tokenizer
from tokenizer_fixtures import (  # noqa: F401 (fixtures)
    EMBEDDED,
    ENDOFTEXT,
    IM_END,
    byte_level,
    embedded,
    needs_embedded,
    save_byte_level,
    save_sentencepiece_like,
    sentencepiece,
)

PIECES = list("abc EN\n\t.") + ["é", "你", "😀", "👍🏽", "\u0301", "\x00", "<|im_end|>"]
TEXT = st.one_of(st.lists(st.sampled_from(PIECES), max_size=20).map("".join), st.text(max_size=20))


@pytest.fixture(scope="module", params=["byte_level", pytest.param("embedded", marks=needs_embedded)])
def bpe(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


def with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return dataclasses.replace(tok, chat_template=template)


# ---------------------------------------------------------------- loading


def test_special_ids_are_the_special_added_tokens(byte_level):
    names = {byte_level.hf.id_to_token(i) for i in byte_level.special_ids}
    assert names == {ENDOFTEXT, "<|im_start|>", IM_END}


def test_eos_ids_join_tokenizer_config_and_generation_config(byte_level):
    ids = byte_level.hf.token_to_id
    assert byte_level.eos_token_ids == [ids(IM_END), ids(ENDOFTEXT)]


def test_generation_config_eos_argument_is_added(tmp_path):
    tok = load_tokenizer(str(save_byte_level(tmp_path, generation_eos=False)), generation_config_eos=[0])
    assert tok.eos_token_ids == [tok.hf.token_to_id(IM_END), 0]


def test_bos_and_pad_read_from_tokenizer_config(byte_level):
    assert byte_level.bos_token_id == byte_level.pad_token_id == byte_level.hf.token_to_id(ENDOFTEXT)


def test_chat_template_read_from_jinja_file(tmp_path):
    directory = save_byte_level(tmp_path, chat_template=None)
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    assert load_tokenizer(str(directory)).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_named_chat_templates_use_the_default(tmp_path):
    directory = save_byte_level(tmp_path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(str(directory)).chat_template == "D"


# ---------------------------------------------------------------- encode / decode


@settings(max_examples=80, deadline=None)
@given(text=TEXT)
def test_decode_inverts_encode(bpe, text):
    assert bpe.decode(bpe.encode(text), skip_special_tokens=False) == text


def test_encode_prepends_bos_when_configured(sentencepiece):
    assert sentencepiece.encode("the end")[0] == sentencepiece.bos_token_id


def test_encode_without_special_tokens_adds_no_bos(sentencepiece):
    assert sentencepiece.bos_token_id not in sentencepiece.encode("the end", add_special_tokens=False)


def test_bos_not_doubled_when_the_post_processor_adds_it(tmp_path):
    tok = load_tokenizer(str(save_sentencepiece_like(tmp_path)))
    bos = [("<s>", tok.bos_token_id)]
    tok.hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=bos)
    assert tok.encode("the end")[:2] == [tok.bos_token_id, tok.encode("the end", add_special_tokens=False)[0]]


def test_decode_skips_special_tokens_by_default(byte_level):
    ids = byte_level.encode("a") + [byte_level.hf.token_to_id(IM_END)]
    assert byte_level.decode(ids) == "a"


def test_decode_keeps_special_tokens_when_asked(byte_level):
    ids = byte_level.encode("a") + [byte_level.hf.token_to_id(IM_END)]
    assert byte_level.decode(ids, skip_special_tokens=False) == "a" + IM_END


# ---------------------------------------------------------------- token text and bytes


def test_token_text_of_a_byte_piece_is_the_replacement_character(byte_level):
    first_byte = next(i for i in range(byte_level.vocab_size) if byte_level.token_raw_bytes(i) == b"\xe2")
    assert byte_level.token_text(first_byte) == "\ufffd"


def test_token_text_keeps_the_leading_space(byte_level):
    (token,) = byte_level.encode(" a", add_special_tokens=False)[-1:]
    assert byte_level.token_text(token).startswith(" ")


def test_token_text_of_a_special_token_is_its_content(byte_level):
    assert byte_level.token_text(byte_level.hf.token_to_id(IM_END)) == IM_END


@settings(max_examples=80, deadline=None)
@given(text=TEXT)
def test_token_bytes_concatenate_to_the_utf8_text(bpe, text):
    ids = bpe.encode(text, add_special_tokens=False)
    assert b"".join(bytes(bpe.token_bytes(i)) for i in ids) == text.encode()


def test_token_bytes_of_an_added_token_are_its_content(byte_level):
    assert bytes(byte_level.token_bytes(byte_level.hf.token_to_id("<think>"))) == b"<think>"


def test_token_bytes_of_a_byte_fallback_piece(sentencepiece):
    assert sentencepiece.token_bytes(sentencepiece.hf.token_to_id("<0xC3>")) == [0xC3]


# ---------------------------------------------------------------- chat template

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_chat_template_renders_chatml(byte_level):
    assert byte_level.apply_chat_template(CHAT) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_generation_prompt_only_when_asked(byte_level):
    assert not byte_level.apply_chat_template(CHAT, add_generation_prompt=False).endswith("assistant\n")


def test_tools_rendered_with_tojson_keeping_non_ascii(byte_level):
    rendered = byte_level.apply_chat_template(CHAT, tools=[{"name": "météo", "x": "<b>"}])
    assert '{"name": "météo", "x": "<b>"}' in rendered


def test_template_variables_include_bos_eos_and_extra_kwargs(byte_level):
    tok = with_template(byte_level, "{{ bos_token }}|{{ eos_token }}|{{ enable_thinking }}")
    assert tok.apply_chat_template(CHAT, enable_thinking=False) == f"{ENDOFTEXT}|{IM_END}|False"


def test_trim_and_lstrip_blocks_as_transformers(byte_level):
    template = "{% for m in messages %}\n    {% if m.role %}\n{{ m.role }};\n    {% endif %}\n{% endfor %}"
    tok = with_template(byte_level, template)
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == "system;\nuser;\n"


def test_raise_exception_becomes_value_error(byte_level):
    with pytest.raises(ValueError, match="unknown role: robot"):
        byte_level.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_missing_chat_template_is_value_error(byte_level):
    with pytest.raises(ValueError, match="no chat template"):
        with_template(byte_level, None).apply_chat_template(CHAT)


def test_unparsable_template_is_value_error(byte_level):
    with pytest.raises(ValueError, match="does not parse"):
        with_template(byte_level, "{% for m in messages %}").apply_chat_template(CHAT)


def test_sandbox_refuses_to_mutate_messages(byte_level):
    with pytest.raises(ValueError):
        with_template(byte_level, "{{ messages.append(1) }}").apply_chat_template(CHAT)


def test_generation_block_renders_its_body(byte_level):
    tok = with_template(byte_level, "a{% generation %}b{% endgeneration %}c")
    assert tok.apply_chat_template(CHAT) == "abc"


def test_continue_final_message_ends_at_the_message(byte_level):
    chat = CHAT + [{"role": "assistant", "content": "Sure, "}]
    rendered = byte_level.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
    assert rendered.endswith("<|im_start|>assistant\nSure, ")


def test_continue_final_message_with_generation_prompt_is_rejected(byte_level):
    with pytest.raises(ValueError):
        byte_level.apply_chat_template(CHAT, add_generation_prompt=True, continue_final_message=True)


@needs_embedded
def test_embedded_chat_template_matches_transformers(embedded):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast.from_pretrained(str(EMBEDDED))
    call = {"type": "function", "function": {"name": "w", "arguments": {"city": "Zürich"}}}
    chat = [
        {"role": "system", "content": "Be brief, é."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
    ]
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "w", "parameters": parameters}}]
    expected = reference.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    assert embedded.apply_chat_template(chat, tools=tools) == expected


def test_ids_the_model_has_beyond_the_tokenizer_write_no_text():
    tokenizer = load_tokenizer(str(EMBEDDED))
    beyond = tokenizer.vocab_size + 100  # a padded embedding row, or a dummy shape's larger vocab
    assert tokenizer.token_raw_bytes(beyond) == b""
    assert tokenizer.token_text(beyond) == ""
