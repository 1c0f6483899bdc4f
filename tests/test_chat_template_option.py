"""--chat-template FILE_OR_STRING, as vLLM takes it: a file's text, else the template itself."""

from __future__ import annotations

import pytest

from tailrace.tokenizer import read_chat_template

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_a_file_gives_its_text(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE


def test_a_template_string_is_the_template():
    assert read_chat_template(TEMPLATE) == TEMPLATE


def test_a_missing_file_is_named():
    with pytest.raises(ValueError, match="--chat-template 'templates/none.jinja': no such file"):
        read_chat_template("templates/none.jinja")
