"""Argument types and actions for the command line, so that a bad value stops the program before
anything starts, with the `serve` usage and the valid values."""

from __future__ import annotations

import argparse
import json
import re

from tailrace.engine.config import DEVICES
from tailrace.engine.speculation.config import SpeculativeConfig, parse_speculative_config

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's names
_TOKEN_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgG]?)")


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an unknown flag gets this subcommand's usage (`tailrace serve ...`),
    not the top level's, which lists only the subcommands."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error("unrecognized arguments: " + " ".join(extras))
        return namespace, extras


class RefuseRemoteCode(argparse.Action):
    """`--trust-remote-code`: accepted by name so that vLLM command lines get a clear answer."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        parser.error("--trust-remote-code is refused: tailrace runs no code from a checkpoint; it serves "
                     "Llama-family models with its own implementation, and needs no remote code for them")


def dtype_name(text: str) -> str:
    """A dtype, with vLLM's aliases `half` and `float`; argparse's `choices` then lists DTYPE_NAMES."""
    return _DTYPE_ALIASES.get(text, text)


def token_count(text: str) -> int:
    """A number of tokens, also in vLLM's short form: 1k = 1000, 1K = 1024, 25.6k = 25600 (m, g alike)."""
    match = _TOKEN_COUNT.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (an integer, or such as 32k or 128K)")
    number, suffix = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    value = float(number) * scale
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"not a whole, positive number of tokens: {text!r}")
    return int(value)


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a fraction in (0, 1], such as 0.9; got {text}")
    return value


def tensor_parallel_size(text: str) -> int:
    """Ranks to split the model over: a positive whole number (whether the model's heads divide by it
    is checked when the model loads)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: the tensor-parallel size is at least 1")
    return value


def json_string_list(text: str) -> list[str]:
    """vLLM's list flags take a JSON list, such as '["https://example.com"]'."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError('a JSON list of strings, such as \'["https://example.com"]\'')
    return value


def device_name(text: str) -> str:
    kind, colon, index = text.partition(":")
    if kind not in DEVICES or (colon and (kind != "cuda" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(DEVICES)}, or cuda:N)")
    return text


def speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config's JSON, checked as the engine reads it."""
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
