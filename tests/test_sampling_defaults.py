"""The model's generation_config.json as the defaults of requests that leave sampling unset."""

import json

import pytest

from tailrace.serving.protocol import ChatCompletionRequest
from tailrace.serving.sampling_defaults import load_sampling_defaults, with_sampling_defaults

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def write_generation_config(directory, **values):
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    return str(directory)


def test_auto_reads_the_models_recommended_sampling(tmp_path):
    model = write_generation_config(tmp_path, temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                                    repetition_penalty=1.1, do_sample=True)
    assert load_sampling_defaults("auto", model) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                                     "repetition_penalty": 1.1}


def test_transformers_own_defaults_are_not_taken_as_the_models_wish(tmp_path):
    model = write_generation_config(tmp_path, temperature=1.0, top_p=1.0, top_k=50, repetition_penalty=1.0)
    assert load_sampling_defaults("auto", model) == {}


def test_vllm_ignores_the_models_file(tmp_path):
    assert load_sampling_defaults("vllm", write_generation_config(tmp_path, temperature=0.6)) == {}


def test_auto_without_a_file_is_no_defaults(tmp_path):
    assert load_sampling_defaults("auto", str(tmp_path)) == {}


def test_a_directory_is_read_instead_of_the_models(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    write_generation_config(other, temperature=0.3)
    assert load_sampling_defaults(str(other), str(tmp_path)) == {"temperature": 0.3}


def test_a_directory_without_the_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_sampling_defaults(str(tmp_path), str(tmp_path))


def test_a_missing_directory_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_sampling_defaults(str(tmp_path / "absent"), str(tmp_path))


def test_defaults_fill_only_what_the_request_left_unset():
    request = ChatCompletionRequest.model_validate({**CHAT, "temperature": 0.0})
    filled = with_sampling_defaults(request, {"temperature": 0.6, "top_p": 0.9})
    params = filled.to_sampling_params()
    assert (params.temperature, params.top_p) == (0.0, 0.9)


def test_no_defaults_leave_the_request_as_it_is():
    request = ChatCompletionRequest.model_validate(CHAT)
    assert with_sampling_defaults(request, {}) is request
