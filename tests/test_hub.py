"""Hub ids resolve through the local Hugging Face cache, offline, to a snapshot directory; an id the
cache lacks, with no network to fetch it, is one error naming the id and the cache."""

from __future__ import annotations

import pickle
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError
from hub_cache import add_to_cache

from tailrace import LLM, SamplingParams
from tailrace.engine.config import EMBEDDED_MODEL, EngineConfig
from tailrace.model.loading.hub import resolve_model, served_name

MAIN, OTHER = "a" * 40, "b" * 40


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A hub cache holding the embedded model as acme/tiny (main) and, files alike, at a v2 tag."""
    add_to_cache(tmp_path, "acme/tiny", Path(EMBEDDED_MODEL), MAIN)
    add_to_cache(tmp_path, "acme/tiny", Path(EMBEDDED_MODEL), OTHER, branch="v2")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_hub_id_resolves_to_its_cached_snapshot(cache):
    assert resolve_model("acme/tiny") == str(cache / "models--acme--tiny" / "snapshots" / MAIN)


def test_revision_selects_its_snapshot(cache):
    assert resolve_model("acme/tiny", revision="v2").endswith(OTHER)


def test_commit_revision_selects_its_snapshot(cache):
    assert resolve_model("acme/tiny", revision=OTHER).endswith(OTHER)


def test_uncached_id_offline_names_the_id_and_the_cache(cache):
    with pytest.raises(ValueError, match=f"model acme/other is not in the Hugging Face cache {cache}, and HF_HUB_OFFLINE"):
        resolve_model("acme/other")


def test_uncached_id_online_is_downloaded_with_what_serving_reads(cache, monkeypatch):
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        return EMBEDDED_MODEL

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model("acme/other", revision="v3") == EMBEDDED_MODEL
    assert calls[1] == {"revision": "v3", "cache_dir": str(cache),
                        "allow_patterns": ["*.json", "*.safetensors", "*.jinja"]}


def test_failed_download_names_the_id_the_cache_and_the_failure(cache, monkeypatch):
    def snapshot_download(repo_id, **kwargs):
        raise LocalEntryNotFoundError("not cached") if kwargs.get("local_files_only") else OSError("no route to host")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(ValueError, match=f"acme/other is not in the Hugging Face cache {cache}, and downloading "
                                         "it failed: no route to host"):
        resolve_model("acme/other")


def test_a_model_directory_is_its_own_path():
    assert resolve_model(EMBEDDED_MODEL) == EMBEDDED_MODEL


def test_a_snapshot_of_gguf_files_names_them(tmp_path, cache):
    (tmp_path / "ggufs").mkdir()
    (tmp_path / "ggufs" / "model-q8_0.gguf").write_bytes(b"")
    add_to_cache(cache, "acme/tiny-gguf", tmp_path / "ggufs", MAIN)
    with pytest.raises(ValueError, match="acme/tiny-gguf: .* has no config.json.*serve one of its GGUF files by "
                                         "its path: model-q8_0.gguf"):
        resolve_model("acme/tiny-gguf")


def test_a_missing_path_is_named(tmp_path):
    with pytest.raises(ValueError, match="model not found: .*nowhere/at/all"):
        resolve_model(str(tmp_path / "nowhere" / "at" / "all"))


def test_served_name_of_a_hub_id_is_the_id_and_of_a_path_its_name(tmp_path):
    assert (served_name("acme/tiny"), served_name(str(tmp_path / "model.gguf"))) == ("acme/tiny", "model.gguf")


def test_engine_config_carries_the_resolved_path_to_the_core(cache, monkeypatch, tmp_path_factory):
    config = EngineConfig(model="acme/tiny", revision="v2")
    config.validate()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("empty-cache")))
    assert pickle.loads(pickle.dumps(config)).model_path.endswith(OTHER)


def test_llm_from_a_hub_id_generates_as_the_directory(cache):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(threads=1).generate("The list type", params)[0].outputs[0].token_ids
    assert LLM("acme/tiny", threads=1).generate("The list type", params)[0].outputs[0].token_ids == want
