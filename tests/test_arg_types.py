"""Argument types: bad values are refused by the parser, vLLM's spellings are accepted."""

import argparse

import pytest

from tailrace.arg_types import device_name, dtype_name, fraction, json_string_list, tensor_parallel_size, token_count


@pytest.mark.parametrize(("text", "tokens"), [("4096", 4096), ("32k", 32000), ("32K", 32768), ("25.6k", 25600),
                                              ("1M", 2**20), ("2m", 2_000_000)])
def test_token_count_reads_vllms_short_forms(text, tokens):
    assert token_count(text) == tokens


@pytest.mark.parametrize("text", ["", "3x", "-5", "0", "1.5", "k"])
def test_token_count_refuses_what_is_no_whole_positive_count(text):
    with pytest.raises(argparse.ArgumentTypeError):
        token_count(text)


def test_dtype_reads_vllms_aliases():
    assert (dtype_name("half"), dtype_name("float"), dtype_name("bfloat16")) == ("float16", "float32", "bfloat16")


@pytest.mark.parametrize("text", ["0", "1.5", "-0.1", "nan"])
def test_fraction_is_in_zero_to_one(text):
    with pytest.raises(argparse.ArgumentTypeError):
        fraction(text)


def test_fraction_takes_one():
    assert fraction("1") == 1.0


def test_tensor_parallel_size_is_a_positive_whole_number():
    assert tensor_parallel_size("1") == 1
    assert tensor_parallel_size("2") == 2


@pytest.mark.parametrize("text", ["0", "-2", "two", "1.5"])
def test_tensor_parallel_size_below_one_or_not_whole_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        tensor_parallel_size(text)


@pytest.mark.parametrize("text", ["auto", "cpu", "cuda", "cuda:1"])
def test_device_names(text):
    assert device_name(text) == text


@pytest.mark.parametrize("text", ["gpu", "cpu:0", "cuda:", "cuda:x", "tpu"])
def test_unknown_device_is_refused_with_the_choices(text):
    with pytest.raises(argparse.ArgumentTypeError, match="auto, cpu, cuda"):
        device_name(text)


def test_json_string_list():
    assert json_string_list('["https://a.example", "*"]') == ["https://a.example", "*"]


@pytest.mark.parametrize("text", ["https://a.example", '{"a": 1}', "[1]"])
def test_json_string_list_refuses_anything_else(text):
    with pytest.raises(argparse.ArgumentTypeError):
        json_string_list(text)
