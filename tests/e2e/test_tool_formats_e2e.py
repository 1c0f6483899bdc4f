"""Forced tool calls end to end, for each served architecture whose model writes a tool-call format:
a random checkpoint of the architecture, served with its model's real chat template
(tests/templates/) and a tokenizer built as the model's own is, through the openai (Chat
Completions and Responses) and anthropic clients, streamed and not.

The tokenizers are llama.cpp's tokenizer-only GGUF files (Qwen2's and Llama 3's byte-level BPE,
LLaMA's SentencePiece; from the llama-cpp-python sdist, `llamacpp_tree`) with the instruct model's
added tokens in the slots the model puts them: Qwen2.5's and Qwen3's at their ids (the base
vocabulary holds placeholders there), Llama 3.1's <|python_tag|> and <|eom_id|> at theirs,
SmolLM3's in Llama 3's reserved slots, Mistral's control tokens after LLaMA's vocabulary.
gpt-oss's o200k and Granite's vocabularies are not in that folder: those two take the embedded
byte-level BPE with their model's special tokens added.

For every case:
- the start-up log names the format the template implies;
- each forced call names a declared function and its arguments are valid for its schema;
- a streamed answer is the non-streamed one (greedy), and each call's arguments arrive once;
- a conversation holding the call and its result renders through the real template and is answered.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import openai
import pytest
import torch
import transformers
from architectures import tiny
from tokenizers import AddedToken, Tokenizer

from tailrace.model.loading.gguf_file import open_gguf
from tailrace.model.loading.gguf_tokenizer import build_tokenizer

from e2e.conftest import serving

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
EMBEDDED = Path(__file__).resolve().parents[2] / "tailrace" / "models" / "tiny"
CITY = {"type": "string", "enum": ["Paris", "Oslo"]}
DAYS = {"type": "integer", "enum": [1, 2, 3]}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": CITY, "days": DAYS}, "required": ["city", "days"],
                          "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The time in a zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}}
FUNCTIONS = {f["name"]: f for f in (WEATHER, TIME)}
QUESTION = "What is the weather in Paris tomorrow?"
MAX_TOKENS = 96

# Added tokens: id (None: after the vocabulary) -> (text, special)
QWEN25 = {151643: ("<|endoftext|>", True), 151644: ("<|im_start|>", True), 151645: ("<|im_end|>", True),
          151657: ("<tool_call>", False), 151658: ("</tool_call>", False)}
QWEN3 = {**QWEN25, 151665: ("<tool_response>", False), 151666: ("</tool_response>", False),
         151667: ("<think>", False), 151668: ("</think>", False)}
LLAMA31 = {128008: ("<|eom_id|>", True), 128010: ("<|python_tag|>", True)}
SMOLLM3 = {128002: ("<think>", False), 128003: ("</think>", False), 128011: ("<|im_start|>", True),
           128012: ("<|im_end|>", True), 128015: ("<tool_call>", False), 128016: ("</tool_call>", False)}
MISTRAL = {None: [(t, True) for t in ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                      "[TOOL_RESULTS]", "[/TOOL_RESULTS]")]}
HARMONY = {None: [(t, True) for t in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                                      "<|return|>", "<|call|>")]}
GRANITE = {None: [(t, True) for t in ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>")]}


SEVERAL = "several per turn, ids as issued"
SHORT_IDS = "several per turn, ids cut to their last 9 characters"


@dataclass(frozen=True)
class Case:
    architecture: str
    vocabulary: str  # llama.cpp's ggml-vocab-NAME.gguf, or "embedded"
    added: dict
    template: str  # a file in tests/templates
    tool_format: str  # what the start-up log names
    fit: str  # what the start-up log says the template takes of calls
    bos: str | None
    eos: str
    config: dict = field(default_factory=dict)


CASES = {
    "qwen2": Case("qwen2", "qwen2", QWEN25, "Qwen-Qwen2.5-7B-Instruct.jinja", "hermes", SEVERAL, None, "<|im_end|>"),
    "qwen3": Case("qwen3", "qwen2", QWEN3, "Qwen-Qwen3-0.6B.jinja", "hermes", SEVERAL, None, "<|im_end|>"),
    "qwen3_moe": Case("qwen3_moe", "qwen2", QWEN3, "Qwen3-Coder.jinja", "qwen3_coder", SEVERAL, None, "<|im_end|>"),
    "llama": Case("llama", "llama-bpe", LLAMA31, "meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3",
                  "one per turn, ids as issued", "<|begin_of_text|>", "<|eot_id|>"),
    "smollm3": Case("smollm3", "llama-bpe", SMOLLM3, "HuggingFaceTB-SmolLM3-3B.jinja", "none", SEVERAL, None,
                    "<|im_end|>"),
    "mistral": Case("mistral", "llama-spm", MISTRAL, "mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral",
                    SHORT_IDS, "<s>", "</s>"),
    "mixtral": Case("mixtral", "llama-spm", MISTRAL, "mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral",
                    SHORT_IDS, "<s>", "</s>"),
    "gpt_oss": Case("gpt_oss", "embedded", HARMONY, "openai-gpt-oss-120b.jinja", "openai", SEVERAL, None, "<|return|>",
                    {"sliding_window": 128, "attention_bias": True}),
    "granite": Case("granite", "embedded", GRANITE, "ibm-granite-granite-3.3-2B-Instruct.jinja", "granite", SEVERAL,
                    None, "<|end_of_text|>"),
}


def base_tokenizer(tree: Path, vocabulary: str) -> Tokenizer:
    if vocabulary == "embedded":
        return Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))
    return build_tokenizer(open_gguf(str(tree / "models" / f"ggml-vocab-{vocabulary}.gguf")))


def instruct_tokenizer(base: Tokenizer, added: dict) -> Tokenizer:
    """`base` with the instruct model's added tokens: each numbered one replaces the placeholder
    in its slot, and the rest follow the vocabulary."""
    spec = json.loads(base.to_str())
    vocab = spec["model"]["vocab"]
    by_id = {i: piece for piece, i in vocab.items()} if isinstance(vocab, dict) else None
    entries = {entry["id"]: entry for entry in spec["added_tokens"]}
    for token_id, value in added.items():
        if token_id is None:
            continue
        text, special = value
        if by_id is not None:
            vocab[text] = vocab.pop(by_id[token_id])
        entries[token_id] = {"id": token_id, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": special}
    spec["added_tokens"] = sorted(entries.values(), key=lambda entry: entry["id"])
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    for text, special in added.get(None, []):
        tokenizer.add_tokens([AddedToken(text, special=special, normalized=False)])
    return tokenizer


def save_case(directory: Path, case: Case, tree: Path) -> Path:
    """The checkpoint: the tokenizer, the template, and random weights for its vocabulary."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = instruct_tokenizer(base_tokenizer(tree, case.vocabulary), case.added)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"eos_token": case.eos, "bos_token": case.bos, "add_bos_token": False,
                "chat_template": (TEMPLATES / case.template).read_text()}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    values = tiny(case.architecture, **case.config, vocab_size=tokenizer.get_vocab_size(),
                  eos_token_id=tokenizer.token_to_id(case.eos), tie_word_embeddings=True, max_position_embeddings=4096,
                  bos_token_id=tokenizer.token_to_id(case.bos) if case.bos else None)
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(directory)
    return directory


@dataclass
class Served:
    case: Case
    url: str
    log: Path


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request: pytest.FixtureRequest, llamacpp_tree: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    case = CASES[request.param]
    directory = tmp_path_factory.mktemp(f"tools-{request.param}")
    model = save_case(directory / "model", case, llamacpp_tree)
    log = directory / "server.log"
    for url in serving([str(model), "--served-model-name", "m", "--max-model-len", "2048", "--max-num-seqs", "4"],
                       log):
        yield Served(case, url, log)


def openai_client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def check_arguments(name: str, arguments: dict) -> None:
    """The arguments are valid for the function's schema (each a value its enum allows)."""
    properties = FUNCTIONS[name]["parameters"]["properties"]
    assert set(arguments) == set(properties), (name, arguments)
    for key, value in arguments.items():
        assert value in properties[key]["enum"], (name, key, value)


def test_the_start_up_log_names_what_the_template_shows_and_takes(served):
    lines = served.log.read_text().splitlines()
    formats = next(line for line in lines if "answer formats:" in line)
    assert f"tool calls = {served.case.tool_format} " in formats, formats
    fit = next(line for line in lines if "tool calls in the chat template:" in line)
    assert fit.endswith(served.case.fit), fit


# A thinking model called with tools forced is asked to answer at once, as a client would ask it.
NO_THINKING = {"reasoning_effort": "none"}
# "required" with one call: random weights would go on calling to the token limit.
CHAT_CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}


def chat_body(tool_choice: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, **NO_THINKING,
            "max_tokens": MAX_TOKENS, "tools": [{"type": "function", "function": f} for f in (WEATHER, TIME)],
            "tool_choice": CHAT_CHOICES[tool_choice], "parallel_tool_calls": False}


@pytest.mark.parametrize("tool_choice", sorted(CHAT_CHOICES))
def test_chat_completions_forced_calls_stream_as_they_answer(served, tool_choice):
    client = openai_client(served)
    whole = client.chat.completions.create(**chat_body(tool_choice))
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and not choice.message.content
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    for name, arguments in calls:
        check_arguments(name, json.loads(arguments))
    if tool_choice == "named":
        assert [name for name, _ in calls] == ["get_weather"]
    names: dict[int, list[str]] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(**chat_body(tool_choice), stream=True):
        for streamed in chunk.choices:
            assert not streamed.delta.content
            for call in streamed.delta.tool_calls or []:
                if call.function.name is not None:
                    names.setdefault(call.index, []).append(call.function.name)
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
            finish = streamed.finish_reason or finish
    assert [(names[i], arguments[i]) for i in sorted(arguments)] == [([name], args) for name, args in calls]
    assert finish == "tool_calls"


def test_a_call_and_its_result_go_back_through_the_template(served):
    client = openai_client(served)
    first = client.chat.completions.create(**chat_body("named")).choices[0].message
    call = first.tool_calls[0]
    history = [{"role": "user", "content": QUESTION},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    answer = client.chat.completions.create(**{**chat_body("named"), "messages": history})
    check_arguments("get_weather", json.loads(answer.choices[0].message.tool_calls[0].function.arguments))


ANTHROPIC_CHOICES = {"any": {"type": "any", "disable_parallel_tool_use": True},
                     "tool": {"type": "tool", "name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", sorted(ANTHROPIC_CHOICES))
def test_anthropic_messages_forced_tool_use_streams_as_it_answers(served, tool_choice):
    client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    body = {"model": "m", "max_tokens": MAX_TOKENS, "extra_body": {"temperature": 0.0},
            "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": QUESTION}],
            "tools": [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
                      for f in (WEATHER, TIME)],
            "tool_choice": ANTHROPIC_CHOICES[tool_choice]}
    whole = client.messages.create(**body)
    assert whole.stop_reason == "tool_use"
    uses = [(block.name, block.input) for block in whole.content if block.type == "tool_use"]
    assert uses and not [block for block in whole.content if block.type == "text" and block.text]
    for name, arguments in uses:
        check_arguments(name, arguments)
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [(block.name, block.input) for block in final.content if block.type == "tool_use"] == uses
    assert final.stop_reason == "tool_use"
    result = client.messages.create(**{**body, "messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [block.model_dump() for block in whole.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": whole.content[-1].id,
                                      "content": "sunny"}]}]})
    assert result.stop_reason == "tool_use"


RESPONSES_CHOICES = {"required": "required", "named": {"type": "function", "name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", sorted(RESPONSES_CHOICES))
def test_responses_forced_function_calls_stream_as_they_answer(served, tool_choice):
    client = openai_client(served)
    body = {"model": "m", "input": QUESTION, "temperature": 0, "max_output_tokens": MAX_TOKENS,
            "reasoning": {"effort": "none"},
            "tools": [{"type": "function", **f} for f in (WEATHER, TIME)],
            "tool_choice": RESPONSES_CHOICES[tool_choice], "parallel_tool_calls": False}
    whole = client.responses.create(**body)
    calls = [(item.name, item.arguments) for item in whole.output if item.type == "function_call"]
    assert calls and not [item for item in whole.output if item.type == "message"]
    for name, arguments in calls:
        check_arguments(name, json.loads(arguments))
    with client.responses.stream(**body) as stream:
        final = stream.get_final_response()
    assert [(item.name, item.arguments) for item in final.output if item.type == "function_call"] == calls
