"""Models from where users keep them, through the real server: a GGUF file converted from the
embedded checkpoint answers as the checkpoint does, and a hub id resolves through a hub cache with
no network (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gguf_writer import write_gguf
from hub_cache import add_to_cache

from e2e.conftest import MODEL, REPO_ROOT, free_port, serving

PROMPTS = ["The list type", "json.dumps", "If the file does not exist,"]
MESSAGES = [{"role": "user", "content": "What does os.path.join do?"}]
OVERRIDE = "{% for m in messages %}Q: {{ m['content'] }}\nA:{% endfor %}"


@pytest.fixture(scope="module")
def gguf_server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("gguf-server")
    yield from serving([str(write_gguf(directory / "tiny-f32.gguf", source=Path(model_dir))), "--max-num-seqs", "4"],
                       directory / "server.log")


@pytest.fixture(scope="module")
def hub_server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("hub-server")
    add_to_cache(directory / "cache", "acme/tiny", Path(model_dir), "c" * 40)
    yield from serving(["acme/tiny", "--max-num-seqs", "4", "--chat-template", OVERRIDE], directory / "server.log",
                       env={"HF_HUB_CACHE": str(directory / "cache"), "HF_HUB_OFFLINE": "1"})


def _greedy(url: str, model: str, headers: dict | None = None) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        texts.append(response.json()["choices"][0]["text"])
    return texts


def _chat_prompt(url: str, model: str, headers: dict | None = None) -> list[int]:
    body = {"model": model, "messages": MESSAGES}
    return httpx.post(f"{url}/tokenize", json=body, headers=headers, timeout=60).json()["tokens"]


def test_gguf_is_served_under_its_file_name(gguf_server):
    assert [card["id"] for card in httpx.get(f"{gguf_server}/v1/models").json()["data"]] == ["tiny-f32.gguf"]


def test_gguf_greedy_completions_are_its_source_checkpoints(gguf_server, server_url, auth):
    assert _greedy(gguf_server, "tiny-f32.gguf") == _greedy(server_url, MODEL, auth)


def test_gguf_chat_prompt_is_its_source_checkpoints(gguf_server, server_url, auth):
    assert _chat_prompt(gguf_server, "tiny-f32.gguf") == _chat_prompt(server_url, MODEL, auth)


def test_hub_id_is_served_under_the_id_from_the_cache_offline(hub_server):
    assert [card["id"] for card in httpx.get(f"{hub_server}/v1/models").json()["data"]] == ["acme/tiny"]


def test_hub_id_greedy_completions_are_the_directorys(hub_server, server_url, auth):
    assert _greedy(hub_server, "acme/tiny") == _greedy(server_url, MODEL, auth)


def test_chat_template_flag_replaces_the_models(hub_server):
    body = {"model": "acme/tiny", "prompt": "Q: What does os.path.join do?\nA:"}
    plain = httpx.post(f"{hub_server}/tokenize", json=body, timeout=60).json()["tokens"]
    assert _chat_prompt(hub_server, "acme/tiny") == plain


def test_unknown_hub_id_offline_stops_the_server_naming_the_id_and_cache(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "tailrace", "serve", "acme/absent", "--port", str(free_port())],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 2
    assert f"model acme/absent is not in the Hugging Face cache {tmp_path}" in result.stderr + result.stdout
