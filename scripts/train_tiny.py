"""Train tailrace's embedded default model from the Python standard library's own docs.

One script, four stages: collect docstrings, train a byte-level BPE tokenizer,
train a tiny Llama with ``transformers.LlamaForCausalLM`` under a wall-clock
budget, and export a directory that ``transformers`` loads unchanged.

    nice -n 15 .venv/bin/python scripts/train_tiny.py --minutes 45 --out tailrace/models/tiny
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import math
import os
import pkgutil
import platform
import random
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# Plain added tokens, as Qwen2.5/Qwen3 ship them, so tool-call and reasoning parsers see real ids.
TEXT_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
VOCAB_SIZE = 8192
MAX_POSITIONS = 2048

# Modules that open browsers, print on import, need a display, or are test suites.
SKIP_TOP_LEVEL = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "pydoc_data",
                  "__phello__", "_pyrepl", "_tkinter", "_testcapi", "_testinternalcapi", "_testbuffer",
                  "_testimportmultiple", "_testmultiphase", "_testsinglephase", "_testclinic", "_xxtestfuzz"}
# Implementation modules whose objects users know under another name.
PUBLIC_NAMES = {"posixpath": "os.path", "_io": "io", "_collections": "collections", "_functools": "functools"}
SKIP_PARTS = {"test", "tests", "idle_test", "__main__"}

CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set has_system = messages and messages[0].role in ['system', 'developer'] -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- text(messages[0].content) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- elif has_system -%}"
    "{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and has_system -%}"
    "{%- elif message.role in ['system', 'developer', 'user'] -%}"
    "{%- set role = 'system' if message.role == 'developer' else message.role -%}"
    "{{- '<|im_start|>' + role + '\\n' + text(message.content) + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- set content = text(message.content) -%}"
    "{%- if content -%}{{- '\\n' + content -}}{%- endif -%}"
    "{%- if message.tool_calls -%}{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' + args + '}\\n</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


SAMPLE_PROMPTS = ["The list type", "Return a new"]
SAMPLE_REPETITION_PENALTY = 1.2

MODEL_CARD = """\
---
license: apache-2.0
language: en
pipeline_tag: text-generation
---

# tailrace tiny (embedded default model)

A {parameters:,}-parameter Llama trained from scratch on the Python standard library's own
documentation. It exists so that tailrace can start, stream and be tested with a real
checkpoint and no downloads. It writes Python-doc-flavoured English; it knows little
and is not meant for real answers.

## Data

- Docstrings of the CPython standard library (modules, classes, functions and methods, walked
  with `pkgutil`/`importlib`/`inspect`; modules with import side effects, GUI and test packages
  skipped) and the reference-manual topics in `pydoc_data.topics`, collected under {software}.
- {documents:,} distinct documents; {val_documents} ({val_tokens:,} tokens) held out for validation,
  {train_documents:,} for training.
- {chat_conversations:,} synthetic ChatML conversations built from training docstrings
  (a question about an object, answered with the docstring's opening sentences; about 30% carry
  a system message), {chat_char_share:.0%} of the training characters.
- Training stream: {train_tokens:,} tokens (sha256 prefix `{train_stream_sha256}`).
- License of the text: Python Software Foundation License (PSF-2.0), copyright the Python
  Software Foundation. The weights ship with tailrace under its Apache-2.0 license.

## Tokenizer

Byte-level BPE (HF `tokenizers`, ByteLevel pre-tokenizer without prefix space, ByteLevel decoder),
{vocab} entries trained on the same training text. Specials: `<|endoftext|>` (id 0; bos and pad),
`<|im_start|>` (1), `<|im_end|>` (2; eos). Plain added tokens, as in Qwen2.5/Qwen3: `<tool_call>`,
`</tool_call>`, `<think>`, `</think>`. No bos is prepended automatically. The chat template is ChatML
with Qwen2.5-style tools (`<tools>` listing, `<tool_call>` calls, `<tool_response>` results).

## Architecture

`LlamaForCausalLM`: hidden 256, 4 layers, 8 attention heads and 4 key/value heads (head_dim 32),
MLP 768, vocabulary {vocab}, 2048 positions, RoPE theta 10000, RMSNorm eps 1e-5, tied embeddings,
float32. {parameters:,} parameters.

## Training

- {steps:,} AdamW steps (betas 0.9/0.95, weight decay 0.1, peak lr {lr:g}, cosine to 10% over the
  {schedule}), {tokens_seen:,} tokens seen ({epochs:.1f} passes over the training stream), packed
  random windows of {seq_len} tokens ({batch} per step), the last {long_fraction:.0%} at {long_seq_len} tokens (same tokens per step).
- Wall time {minutes:.1f} min on {hardware}.
- Held-out loss: **{val_loss} nats/token** ({seq_len}-token windows of the held-out documents).

Reproduce (from the repository root):

```
{command}
```

Data, tokenizer and initialisation are bit-identical on the same Python and torch; with a
wall-clock budget the step count follows the CPU time available. `--steps N` replaces the budget
with a fixed step schedule, which repeats exactly run to run.

## Samples

Generated with `transformers` from the shipped weights (greedy, repetition penalty {penalty},
60 new tokens).

{samples}
"""


@dataclass(slots=True)
class Doc:
    name: str  # dotted name users would type, e.g. "json.dumps"; "" for reference-manual topics
    kind: str  # "module", "class", "function", "method" or "topic"
    text: str


# ---------------------------------------------------------------- data


def _stdlib_module_names() -> list[str]:
    names: list[str] = []
    for top in sorted(sys.stdlib_module_names):
        if top in SKIP_TOP_LEVEL or top.startswith(("turtle", "_test", "_xx")):
            continue
        names.append(top)
        names.extend(_submodules(top))
    return names


def _submodules(package: str) -> list[str]:
    module = _quiet_import(package)
    if module is None or not hasattr(module, "__path__"):
        return []
    found: list[str] = []
    for info in sorted(pkgutil.iter_modules(module.__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in SKIP_PARTS:
            continue
        full = f"{package}.{info.name}"
        found.append(full)
        if info.ispkg:
            found.extend(_submodules(full))
    return found


def _quiet_import(name: str):
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except (Exception, SystemExit):
        return None


def _signature(obj) -> str:
    try:
        sig = str(inspect.signature(obj))
    except Exception:  # C signatures can reference attributes that only exist on some builds
        return ""
    sig = re.sub(r" at 0x[0-9a-f]+", "", sig)  # default-value reprs carry addresses that vary per run
    return sig if len(sig) <= 160 else ""


def _own_doc(obj) -> str:
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _member_docs(module, modname: str) -> list[Doc]:
    public = PUBLIC_NAMES.get(modname, modname)
    prefix = "" if modname == "builtins" else public + "."
    docs: list[Doc] = []
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != modname:
            continue
        if inspect.isclass(obj):
            docs.append(Doc(prefix + attr, "class", _own_doc(obj)))
            for meth, member in sorted(vars(obj).items()):
                if meth.startswith("_"):
                    continue
                target = getattr(member, "__func__", member)  # unwrap classmethod/staticmethod
                if callable(target) or isinstance(member, property):
                    name = f"{prefix}{attr}.{meth}"
                    docs.append(Doc(name + _signature(target), "method", _own_doc(target)))
        elif callable(obj):
            docs.append(Doc(prefix + attr + _signature(obj), "function", _own_doc(obj)))
    return docs


def collect_docs() -> list[Doc]:
    """Every distinct stdlib docstring plus the reference-manual topics, in a stable order."""
    docs: list[Doc] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading deprecated attributes warns
        for modname in _stdlib_module_names():
            module = _quiet_import(modname)
            if module is not None:
                docs.append(Doc(modname, "module", _own_doc(module)))
                docs.extend(_member_docs(module, modname))
    from pydoc_data.topics import topics

    docs.extend(Doc("", "topic", text.strip()) for _, text in sorted(topics.items()))
    seen: set[str] = set()
    unique: list[Doc] = []
    for doc in docs:
        if len(doc.text) < 12 or not _plain(doc.text) or doc.text in seen:
            continue
        seen.add(doc.text)
        unique.append(doc)
    return unique


def _plain(text: str) -> bool:
    return all(ch.isprintable() or ch in "\n\t" for ch in text)


def render_doc(doc: Doc) -> str:
    return f"{doc.name}\n\n{doc.text}" if doc.name else doc.text


def _bare_name(doc: Doc) -> str:
    return doc.name.split("(", 1)[0]


def first_sentences(text: str, count: int) -> str:
    """The opening sentences of a docstring, skipping a leading signature line."""
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    while paragraphs and "(" in paragraphs[0] and not paragraphs[0].endswith(".") and len(paragraphs) > 1:
        paragraphs.pop(0)
    if not paragraphs:
        return ""
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", paragraphs[0])
    return " ".join(sentences[:count])[:500]


QUESTIONS = {
    "module": ["What is the `{n}` module for?", "Explain the {n} module.", "Summarise the {n} module."],
    "class": ["Explain the {n} type.", "What is `{n}`?", "Summarise {n}.", "What does the `{n}` class do?"],
    "function": ["What does `{n}` do?", "Summarise {n}.", "Explain `{n}`.", "What is {n} used for?"],
    "method": ["What does `{n}` do?", "Summarise {n}.", "Explain the {n} method."],
}
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant that answers questions about the Python standard library.",
    "Answer briefly, using the official documentation.",
]


def chatml(messages: list[tuple[str, str]]) -> str:
    return "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages)


def build_chats(docs: list[Doc], target_chars: int, rng: random.Random) -> list[str]:
    """Synthetic Q&A conversations whose answers are the docstrings' opening sentences."""
    pairs: list[tuple[str, str]] = []
    for doc in docs:
        if doc.kind == "topic":
            continue
        answer = first_sentences(doc.text, rng.choice([1, 2, 2, 3]))
        if len(answer) >= 20:
            short = _bare_name(doc)
            pairs.append((rng.choice(QUESTIONS[doc.kind]).format(n=short), answer))
    rng.shuffle(pairs)
    chats: list[str] = []
    total = 0
    while pairs and total < target_chars:
        turns = min(len(pairs), rng.choice([1, 1, 1, 2, 3]))
        messages = [("system", rng.choice(SYSTEM_PROMPTS))] if rng.random() < 0.3 else []
        for _ in range(turns):
            question, answer = pairs.pop()
            messages += [("user", question), ("assistant", answer)]
        chats.append(chatml(messages))
        total += len(chats[-1])
    return chats


def split_docs(docs: list[Doc], val_fraction: float, rng: random.Random) -> tuple[list[Doc], list[Doc]]:
    shuffled = docs[:]
    rng.shuffle(shuffled)
    n_val = max(1, int(len(shuffled) * val_fraction))
    return shuffled[n_val:], shuffled[:n_val]


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str]):
    """Byte-level BPE with the chat specials at ids 0-2 and the tool/think markers last."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TEXT_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    # Markers are stripped so merges are learned from prose, not from the special strings.
    markers = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    tokenizer.train_from_iterator((markers.sub("", t) for t in texts), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    return tokenizer


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts concatenated, each closed by <|endoftext|>, as one int32 token stream."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.int32)


def save_tokenizer(tokenizer, out: Path) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    decoder = {
        str(tokenizer.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + TEXT_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": MAX_POSITIONS,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", {"bos_token": ENDOFTEXT, "eos_token": IM_END, "pad_token": ENDOFTEXT})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- model


def build_model(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


def sample_batch(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()]).long()


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def validation_loss(model, val_batches: list[torch.Tensor]) -> float:
    model.eval()
    losses = [lm_loss(model, b).item() for b in val_batches]
    model.train()
    return sum(losses) / len(losses)


def make_optimizer(model, lr: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(progress: float, step: int, warmup: int, peak: float) -> float:
    """Linear warm-up, then cosine from ``peak`` down to a tenth of it as ``progress`` goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_step(model, opt, tokens: torch.Tensor, lr: float) -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    loss = lm_loss(model, tokens)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def export_model(model, out: Path) -> None:
    from transformers import GenerationConfig

    model.save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)  # the writer leaves it owner-only, which breaks shared installs
    GenerationConfig(bos_token_id=0, eos_token_id=[2, 0], pad_token_id=0).save_pretrained(out)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("tailrace/models/tiny"))
    p.add_argument("--minutes", type=float, default=45.0, help="wall-clock budget for the training loop")
    p.add_argument("--steps", type=int, default=0, help="fixed step count (overrides --minutes); 0 = time budget")
    p.add_argument("--batch", type=int, default=8, help="sequences per step at --seq-len")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--long-seq-len", type=int, default=1024, help="length for the final --long-fraction")
    p.add_argument("--long-fraction", type=float, default=0.15)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-minutes", type=float, default=5.0, help="minutes between validation + export")
    p.add_argument("--chat-fraction", type=float, default=0.18)
    return p.parse_args(argv)


def prepare_data(args: argparse.Namespace):
    rng = random.Random(args.seed)
    docs = collect_docs()
    train_docs, val_docs = split_docs(docs, 0.02, rng)
    plain = [render_doc(d) for d in train_docs]
    plain_chars = sum(map(len, plain))
    chats = build_chats(train_docs, int(plain_chars * args.chat_fraction / (1 - args.chat_fraction)), rng)
    train_texts = plain + chats
    rng.shuffle(train_texts)
    tokenizer = train_tokenizer(train_texts)
    train = encode_stream(tokenizer, train_texts)
    val = encode_stream(tokenizer, [render_doc(d) for d in val_docs])
    digest = hashlib.sha256(train.numpy().tobytes()).hexdigest()[:16]
    stats = {
        "documents": len(docs), "train_documents": len(train_docs), "val_documents": len(val_docs),
        "chat_conversations": len(chats), "chat_char_share": round(sum(map(len, chats)) / sum(map(len, train_texts)), 3),
        "train_tokens": len(train), "val_tokens": len(val), "train_stream_sha256": digest,
    }
    return tokenizer, train, val, stats


def val_batches_of(val: torch.Tensor, length: int, max_batches: int = 8, batch: int = 8) -> list[torch.Tensor]:
    usable = (len(val) - 1) // length
    rows = [val[i * length : i * length + length + 1].long() for i in range(min(usable, max_batches * batch))]
    return [torch.stack(rows[i : i + batch]) for i in range(0, len(rows), batch)]


def schedule_progress(args: argparse.Namespace, step: int, elapsed: float) -> float:
    """Fraction of the run done: by steps when --steps is set, else by wall time.

    Wall-clock progress keeps the cosine and the long-context phase inside the budget
    however busy the shared CPU is; --steps gives a bit-reproducible schedule instead.
    """
    if args.steps:
        return step / args.steps
    return elapsed / (args.minutes * 60)


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tokenizer, train_stream, val_stream, stats = prepare_data(args)
    log(f"data ready in {time.time() - t0:.0f}s: {json.dumps(stats)}")
    save_tokenizer(tokenizer, args.out)

    model = build_model(tokenizer.get_vocab_size())
    n_params = sum(p.numel() for p in model.parameters())
    log(f"parameters: {n_params:,}")
    opt = make_optimizer(model, args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    val_batches = val_batches_of(val_stream, args.seq_len)
    long_tokens = args.batch * args.seq_len

    start = time.time()
    step, tokens_seen, last_eval = 0, 0, start
    while (progress := schedule_progress(args, step, time.time() - start)) < 1.0:
        length = args.long_seq_len if progress >= 1 - args.long_fraction else args.seq_len
        batch = max(1, long_tokens // length)
        lr = lr_at(progress, step, args.warmup, args.lr)
        loss = train_step(model, opt, sample_batch(train_stream, batch, length, gen), lr)
        step += 1
        tokens_seen += batch * length
        if step % 20 == 0:
            elapsed = time.time() - start
            log(f"step {step} progress {progress:.3f} len {length} loss {loss:.4f} lr {lr:.2e} "
                f"tok/s {tokens_seen / elapsed:.0f} elapsed {elapsed / 60:.1f}m")
        if time.time() - last_eval > args.eval_minutes * 60:
            log(f"step {step} val_loss {validation_loss(model, val_batches):.4f} (exporting)")
            export_model(model, args.out)
            last_eval = time.time()

    val_loss = validation_loss(model, val_batches)
    export_model(model, args.out)
    summary = {
        **stats, "parameters": n_params, "steps": step, "tokens_seen": tokens_seen,
        "train_wall_seconds": round(time.time() - start), "val_loss": round(val_loss, 4),
        **run_settings(args), "command": reproduce_command(args), "hardware": hardware(args.threads),
        "software": f"Python {platform.python_version()}, torch {torch.__version__}",
    }
    log(f"done: {json.dumps(summary)}")
    samples = generate_samples(args.out)
    for prompt, text in samples:
        log(f"sample {prompt!r}: {text!r}")
    (args.out / "README.md").write_text(model_card(summary, samples))


def reproduce_command(args: argparse.Namespace) -> str:
    flags = f"--minutes {args.minutes:g}" if not args.steps else f"--steps {args.steps}"
    return (f"nice -n 15 .venv/bin/python scripts/train_tiny.py {flags} --batch {args.batch} "
            f"--threads {args.threads} --seed {args.seed} --out {args.out}")


def hardware(threads: int) -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = re.findall(r"model name\s*:\s*(.+)", cpuinfo.read_text()) if cpuinfo.exists() else []
    cpu = names[0] if names else platform.machine()
    return f"{cpu}, {os.cpu_count()} vCPUs shared with other jobs, {threads} torch thread(s) at nice 15"


def generate_samples(model_dir: Path) -> list[tuple[str, str]]:
    """Greedy continuations from the exported weights, loaded the way users load them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "What does `json.dumps` do?"}],
                                   tokenize=False, add_generation_prompt=True)
    results = []
    for prompt in SAMPLE_PROMPTS + [chat]:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=60, do_sample=False, repetition_penalty=SAMPLE_REPETITION_PENALTY)
        results.append((prompt, tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
    return results


def model_card(summary: dict, samples: list[tuple[str, str]]) -> str:
    sample_text = "\n\n".join(f"Prompt:\n```\n{p}\n```\nGreedy continuation:\n```\n{t}\n```" for p, t in samples)
    return MODEL_CARD.format(**summary, samples=sample_text, minutes=summary["train_wall_seconds"] / 60,
                             epochs=summary["tokens_seen"] / summary["train_tokens"],
                             penalty=SAMPLE_REPETITION_PENALTY, vocab=VOCAB_SIZE)


def run_settings(args: argparse.Namespace) -> dict:
    schedule = f"{args.steps} steps" if args.steps else f"{args.minutes:g}-minute wall-clock budget"
    keys = ["lr", "batch", "seq_len", "long_seq_len", "long_fraction", "seed"]
    return {"schedule": schedule, **{k: getattr(args, k) for k in keys}}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
