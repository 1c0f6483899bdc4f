"""How an embedding model pools, read from its folder as sentence-transformers reads it, and what
`--task` serves: auto embeds a sentence-transformers folder or a base model, scores pairs with a
sequence classifier (a cross-encoder, through its configured activation) and generates with
anything else; modules, modes and activations that cannot be served stop the server by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from architectures import tiny
from embedding_models import save_embedding_model

from tailrace.serving.pooling import Pooling, read_pooling, resolve_task


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_embedding_model(tmp_path_factory.mktemp("st") / "model", pooling="mean", normalize=False)


def write_config(directory: Path, **config: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_modules_json_names_the_pooling_and_the_normalize_module(folder):
    prompts = {"query": "Instruct: find the code\nQuery: ", "document": ""}
    assert read_pooling(str(folder)) == Pooling("mean", False, prompts=prompts)
    pooling, line = resolve_task("auto", str(folder))
    assert pooling.method == "mean" and line == "task: embed (modules.json): the mean of the tokens' hidden state"


def test_a_base_model_embeds_by_its_last_token_normalized_and_cannot_generate(tmp_path):
    base = write_config(tmp_path / "base", **tiny("qwen3", architectures=["Qwen3Model"], is_matryoshka=True))
    pooling, line = resolve_task("auto", str(base))
    assert pooling == Pooling("last", True, matryoshka=True)
    assert line == "task: embed (Qwen3Model has no head): the last token's hidden state, normalized"
    with pytest.raises(ValueError, match="Qwen3Model is a base model .* serve it with --task embed"):
        resolve_task("generate", str(base))


def test_a_causal_model_generates_unless_told_to_embed(tmp_path):
    causal = write_config(tmp_path / "causal", **tiny("qwen3"))
    assert resolve_task("auto", str(causal)) == (None, "task: generate")
    assert resolve_task("embed", str(causal))[0] == Pooling("last", True)


@pytest.mark.parametrize("change,words", [
    ({"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}, "pooling_mode_max_tokens"),
    ({"pooling_mode_cls_token": True}, "pooling_mode_mean_tokens, pooling_mode_cls_token;"),
])
def test_pooling_modes_that_cannot_be_served_are_named(folder, tmp_path, change, words):
    copy = tmp_path / "copy"
    (copy / "1_Pooling").mkdir(parents=True)
    (copy / "modules.json").write_text((folder / "modules.json").read_text())
    settings = json.loads((folder / "1_Pooling" / "config.json").read_text())
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({**settings, **change}))
    with pytest.raises(ValueError, match=words):
        read_pooling(str(copy))


def test_a_module_that_cannot_be_served_is_named(folder, tmp_path):
    copy = tmp_path / "dense"
    copy.mkdir()
    modules = json.loads((folder / "modules.json").read_text())
    (copy / "modules.json").write_text(json.dumps([*modules, {"idx": 9, "name": "9", "path": "2_LSTM",
                                                              "type": "sentence_transformers.models.LSTM"}]))
    with pytest.raises(ValueError, match="the module 'LSTM' cannot be served"):
        read_pooling(str(copy))


def test_modules_run_in_sentence_transformers_order(folder, tmp_path):
    copy = tmp_path / "order"
    copy.mkdir()
    modules = json.loads((folder / "modules.json").read_text())
    dense = {"idx": 9, "name": "9", "path": "2_Dense", "type": "sentence_transformers.base.modules.dense.Dense"}
    (copy / "modules.json").write_text(json.dumps([modules[0], dense, *modules[1:]]))
    with pytest.raises(ValueError, match="run in the order Transformer, Dense, Pooling"):
        read_pooling(str(copy))


def test_the_default_prompt_must_be_one_of_the_prompts(folder, tmp_path):
    copy = tmp_path / "prompts"
    shutil.copytree(folder, copy)
    settings = json.loads((copy / "config_sentence_transformers.json").read_text())
    (copy / "config_sentence_transformers.json").write_text(json.dumps({**settings, "default_prompt_name": "query"}))
    assert read_pooling(str(copy)).default_prompt == "query"
    (copy / "config_sentence_transformers.json").write_text(json.dumps({**settings, "default_prompt_name": "x"}))
    with pytest.raises(ValueError, match="default_prompt_name 'x' is not among its prompts"):
        read_pooling(str(copy))


def test_a_pooling_that_leaves_the_prompt_out_is_refused(folder, tmp_path):
    copy = tmp_path / "no-prompt"
    shutil.copytree(folder, copy)
    settings = json.loads((copy / "1_Pooling" / "config.json").read_text())
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({**settings, "include_prompt": False}))
    with pytest.raises(ValueError, match="include_prompt false"):
        read_pooling(str(copy))


def test_a_sequence_classifier_scores_pairs_and_nothing_else(tmp_path):
    classifier = write_config(tmp_path / "ce", architectures=["BertForSequenceClassification"],
                              id2label={"0": "LABEL_0"})
    pooling, line = resolve_task("auto", str(classifier))
    assert pooling == Pooling("score", False, score_activation="sigmoid")
    assert resolve_task("score", str(classifier)) == (pooling, line)
    assert line == ("task: score (BertForSequenceClassification): each pair's classifier output on its first token, "
                    "through sigmoid")
    for task, verb in (("generate", "generate"), ("embed", "embed")):
        with pytest.raises(ValueError, match=f"is a cross-encoder: .* cannot {verb}; serve it with --task score"):
            resolve_task(task, str(classifier))


def test_only_a_sequence_classifier_is_served_with_task_score(folder):
    with pytest.raises(ValueError, match="--task score serves a sequence classifier"):
        resolve_task("score", str(folder))


@pytest.mark.parametrize("config,result", [
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, "identity"),
    ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"}, "sigmoid"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}, "cannot be served"),
    ({"id2label": {"0": "no", "1": "yes"}}, "has 2 labels"),
])
def test_the_cross_encoders_activation_is_its_configs(tmp_path, config, result):
    folder = write_config(tmp_path / "ce", architectures=["XLMRobertaForSequenceClassification"],
                          **{"id2label": {"0": "LABEL_0"}, **config})
    if result in ("identity", "sigmoid"):
        assert resolve_task("auto", str(folder))[0].score_activation == result
    else:
        with pytest.raises(ValueError, match=result):
            resolve_task("auto", str(folder))


def test_sentence_transformers_6_keeps_the_activation_in_its_own_config(tmp_path):
    folder = write_config(tmp_path / "ce", architectures=["BertForSequenceClassification"],
                          id2label={"0": "LABEL_0"},
                          sentence_transformers={"activation_fn": "torch.nn.modules.activation.Sigmoid"})
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"activation_fn": "torch.nn.modules.linear.Identity"}))
    assert resolve_task("auto", str(folder))[0].score_activation == "identity"


def write_logit_scorer(folder: Path, modules: list[str], task: str = "text-generation", **settings: object) -> Path:
    folder = write_config(folder, architectures=["Qwen3ForCausalLM"])
    (folder / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": "" if kind == "Transformer" else f"{i}_{kind}",
         "type": f"sentence_transformers.base.modules.{kind}"} for i, kind in enumerate(modules)]))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"transformer_task": task, **settings}))
    return folder


def test_a_language_model_with_a_logit_score_module_scores_with_its_template_settings(tmp_path):
    folder = write_logit_scorer(tmp_path / "rr", ["Transformer", "LogitScore"], processing_kwargs={
        "chat_template": {"add_generation_prompt": True, "restore_suffix": True, "enable_thinking": False}})
    pooling, line = resolve_task("score", str(folder))
    assert (pooling.method, pooling.score_activation) == ("logits", "sigmoid")
    assert pooling.template_settings == {"add_generation_prompt": True, "enable_thinking": False}
    assert line.startswith("task: score (Qwen3ForCausalLM with LogitScore): each pair as its chat template renders")


@pytest.mark.parametrize("modules,task,words", [
    (["Transformer", "Pooling", "LogitScore"], "text-generation", "a Transformer, then a LogitScore module"),
    (["Transformer", "LogitScore"], "feature-extraction", "not 'text-generation'"),
])
def test_a_logit_score_layout_that_cannot_be_served_is_named(tmp_path, modules, task, words):
    with pytest.raises(ValueError, match=words):
        resolve_task("auto", str(write_logit_scorer(tmp_path / "rr", modules, task)))


@pytest.mark.parametrize("mode,result", [("lasttoken", "last"), (["cls"], "cls"), ("mean", "mean"),
                                         ("max", "'max'; one of lasttoken, mean, cls"),
                                         (["mean", "max"], "one of lasttoken, mean, cls, alone")])
def test_sentence_transformers_6_names_the_pooling_mode(folder, tmp_path, mode, result):
    copy = tmp_path / "st6"
    shutil.copytree(folder, copy)
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 64, "pooling_mode": mode}))
    if result in ("last", "cls", "mean"):
        assert read_pooling(str(copy)).method == result
    else:
        with pytest.raises(ValueError, match=result):
            read_pooling(str(copy))
