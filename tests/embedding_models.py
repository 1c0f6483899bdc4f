"""Embedding checkpoints the tests write: a random decoder saved by transformers as its base model
(Qwen3-Embedding's layout: `Qwen3Model`, no language-model head), with the byte-level test
tokenizer, and made a sentence-transformers folder (modules.json, a Pooling module and, where
asked, a Normalize module; a query prompt as Qwen3-Embedding's) that sentence-transformers itself
loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from tokenizer_fixtures import save_byte_level
from tokenizers import Tokenizer

from tailrace.engine.core import EngineCore, EngineRequest
from tailrace.sampling_params import SamplingParams

_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def write_modules(directory: Path, hidden: int, pooling: str, normalize: bool, max_seq_length: int) -> None:
    """sentence-transformers' modules in `directory`: a Transformer, a Pooling module of `pooling`,
    and a Normalize module where asked."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **{mode: name == pooling for name, mode in _MODES.items()},
         "pooling_mode_max_tokens": False, "include_prompt": True}))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                     "do_lower_case": False}))


def engine_vectors(engine: EngineCore, prompts: list[list[int]], method: str,
                   starts: list[int | None] | None = None) -> list[np.ndarray]:
    """Each prompt's pooled vector (or classifier outputs) from the engine core, run as one batch;
    `starts`: each pair's second text's first position."""
    starts = starts or [None] * len(prompts)
    for i, (prompt, start) in enumerate(zip(prompts, starts)):
        engine.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=0, pooling=method,
                                                                         segment_start=start)))
    vectors: dict[str, list[float]] = {}
    while engine.has_work():
        for out in engine.step():
            assert not out.new_token_ids
            if out.embedding is not None:
                vectors[out.request_id] = out.embedding
                assert out.finish_reason == "stop"
    return [np.asarray(vectors[f"r{i}"], dtype=np.float32) for i in range(len(prompts))]


def save_embedding_model(directory: Path, pooling: str = "last", normalize: bool = True, seed: int = 0,
                         **config: object) -> Path:
    """A random Qwen3 base model with sentence-transformers' modules; returns the folder."""
    save_byte_level(directory)
    # transformers 5 (which sentence-transformers loads the tokenizer with) takes a special token as a string
    settings_path = directory / "tokenizer_config.json"
    tokenizer_settings = json.loads(settings_path.read_text())
    tokenizer_settings["eos_token"] = tokenizer_settings["eos_token"]["content"]
    settings_path.write_text(json.dumps(tokenizer_settings))
    vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
    settings = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                    initializer_range=0.1)
    torch.manual_seed(seed)
    model = transformers.Qwen3Model(transformers.Qwen3Config(**{**settings, **config}))
    model.float().save_pretrained(directory)
    write_modules(directory, settings["hidden_size"], pooling, normalize, max_seq_length=512)
    (directory / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "Instruct: find the code\nQuery: ", "document": ""}, "default_prompt_name": None,
         "similarity_fn_name": "cosine"}))
    return directory


# Words and pieces of the encoders' test vocabularies: enough that English test sentences tokenize
# into several tokens each, unknown words into pieces.
_WORDS = ("the a an of to in is it and for on with that this what how why which code server model query "
          "document search find python fast slow cat dog sat mat runs stream token text embed rank score "
          "hello world paris france capital city weather today is are be was").split()
_LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789.,?!'-:"


def _save_encoder_tokenizer(directory: Path, family: str) -> None:
    """A tokenizer as the family's own: BERT's WordPiece (lower-cased, [CLS] a [SEP] b [SEP], pairs
    typed 0 and 1) or XLM-R's SentencePiece Unigram (<s> a </s></s> b </s>)."""
    if family == "bert":
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS, *_LETTERS, *(f"##{c}" for c in _LETTERS)]
        transformers.BertTokenizer(vocab={piece: i for i, piece in enumerate(dict.fromkeys(vocab))}).save_pretrained(
            directory)
    else:
        _save_xlm_r_tokenizer(directory)


def _save_xlm_r_tokenizer(directory: Path) -> None:
    """XLM-R's tokenizer as its checkpoints ship it: a SentencePiece Unigram model
    (sentencepiece.bpe.model: <unk>, <s> and </s> first, nmt_nfkc's precompiled character map),
    trained here on sentences of the test words, and the tokenizer.json transformers builds from it
    (<s> and <pad> before the pieces, each piece one id up, <mask> last)."""
    import sentencepiece

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    sentences = [" ".join(rng.choice(_WORDS, 8)) + str(rng.choice(list(".?!,"))) for _ in range(2000)]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_prefix=str(directory / "spm"), vocab_size=200, model_type="unigram",
        hard_vocab_limit=False, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
        minloglevel=2)
    (directory / "spm.model").rename(directory / "sentencepiece.bpe.model")
    (directory / "spm.vocab").unlink()
    transformers.XLMRobertaTokenizer.from_pretrained(directory).save_pretrained(directory)


def encoder_classes(family: str) -> tuple[type, type, type]:
    """transformers' config, base model and sequence classifier classes of an encoder family."""
    if family == "bert":
        return transformers.BertConfig, transformers.BertModel, transformers.BertForSequenceClassification
    return (transformers.XLMRobertaConfig, transformers.XLMRobertaModel,
            transformers.XLMRobertaForSequenceClassification)


def save_encoder_model(directory: Path, family: str = "bert", pooling: str | None = "cls", normalize: bool = True,
                       classifier: bool = False, seed: int = 0, **config: object) -> Path:
    """A random BERT or XLM-R encoder with its family's tokenizer: a sentence-transformers folder
    pooling as asked (pooling None: the plain base model), or with `classifier` a one-label
    sequence classifier as cross-encoders ship it; returns the folder."""
    _save_encoder_tokenizer(directory, family)
    vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
    config_class, base_class, classifier_class = encoder_classes(family)
    roberta = family != "bert"
    settings = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=128 + (2 if roberta else 0),
                    type_vocab_size=1 if roberta else 2, initializer_range=0.2, pad_token_id=1 if roberta else 0)
    torch.manual_seed(seed)
    settings = {**settings, **config}
    if classifier:
        model = classifier_class(config_class(**settings, num_labels=1))
    else:
        model = base_class(config_class(**settings))
    model.float().save_pretrained(directory)
    if pooling is None or classifier:
        return directory
    write_modules(directory, settings["hidden_size"], pooling, normalize, max_seq_length=128)
    return directory


def with_dense(folder: Path, directory: Path, widths: tuple[int, ...] = (32,), tanh: bool = True,
               bias: bool = True) -> Path:
    """`folder`'s model with Dense modules of these output widths (tanh or identity, with or
    without biases) between its Pooling and Normalize modules, saved by sentence-transformers
    itself into `directory` (its current module paths)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense

    model = SentenceTransformer(str(folder), device="cpu")
    torch.manual_seed(1)
    dense, width = [], model.get_embedding_dimension()
    for out in widths:
        dense.append(Dense(width, out, bias=bias, activation_function=torch.nn.Tanh() if tanh else torch.nn.Identity()))
        width = out
    SentenceTransformer(modules=[model[0], model[1], *dense, *list(model)[2:]], device="cpu").save(str(directory))
    return directory


def save_embeddinggemma(directory: Path, seed: int = 0, layers: int = 3) -> Path:
    """EmbeddingGemma's layout, random and small: a Gemma 3 text model with bidirectional attention
    (Gemma3TextModel; sliding layers, whose window bites on the tests' texts, then a full one),
    mean pooling, two Dense modules without biases (out and back), normalized."""
    save_byte_level(directory / "base")
    settings_path = directory / "base" / "tokenizer_config.json"
    tokenizer_settings = json.loads(settings_path.read_text())
    tokenizer_settings["eos_token"] = tokenizer_settings["eos_token"]["content"]
    settings_path.write_text(json.dumps(tokenizer_settings))
    vocab = Tokenizer.from_file(str(directory / "base" / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=512, sliding_window=8,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"], use_bidirectional_attention=True,
        initializer_range=0.1)
    transformers.Gemma3TextModel(config).float().save_pretrained(directory / "base")
    write_modules(directory / "base", 64, "mean", True, max_seq_length=512)
    return with_dense(directory / "base", directory / "model", widths=(128, 64), tanh=False, bias=False)


def save_nomic_models(directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """A random NomicBERT twice, the same weights: as transformers saves NomicBertModel, and as
    nomic-embed-text ships it for its own code (config keys n_embd, ...; q/k/v fused as Wqkv, the
    MLP as fc11 / fc12 / fc2; a context of 8192 trained to 2048); each a sentence-transformers
    folder (mean pooling, normalized) with BERT's tokenizer. Returns (transformers', nomic's)."""
    ours, hub = directory / "transformers", directory / "nomic"
    for folder in (ours, hub):
        _save_encoder_tokenizer(folder, "bert")
    vocab = Tokenizer.from_file(str(ours / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(seed)
    config = transformers.NomicBertConfig(  # head_dim 32: the CPU kernels' rotary runs it
        vocab_size=vocab, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=2048, type_vocab_size=2, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    model = transformers.NomicBertModel(config).float()
    model.save_pretrained(ours)
    state = model.state_dict()
    renamed = {"embeddings.word_embeddings.weight": state["embeddings.word_embeddings.weight"],
               "embeddings.token_type_embeddings.weight": state["embeddings.token_type_embeddings.weight"],
               "emb_ln.weight": state["embeddings.LayerNorm.weight"], "emb_ln.bias": state["embeddings.LayerNorm.bias"]}
    for i in range(config.num_hidden_layers):
        at, to = f"layers.{i}.", f"encoder.layers.{i}."
        renamed[to + "attn.Wqkv.weight"] = torch.cat([state[f"{at}self_attn.{p}_proj.weight"] for p in "qkv"])
        for old, new in (("self_attn.o_proj", "attn.out_proj"), ("mlp.up_proj", "mlp.fc11"),
                         ("mlp.gate_proj", "mlp.fc12"), ("mlp.down_proj", "mlp.fc2")):
            renamed[f"{to}{new}.weight"] = state[f"{at}{old}.weight"]
        for old, new in (("post_attention_layernorm", "norm1"), ("post_mlp_layernorm", "norm2")):
            for kind in ("weight", "bias"):
                renamed[f"{to}{new}.{kind}"] = state[f"{at}{old}.{kind}"]
    save_file({k: v.contiguous() for k, v in renamed.items()}, str(hub / "model.safetensors"))
    (hub / "config.json").write_text(json.dumps({
        "architectures": ["NomicBertModel"], "model_type": "nomic_bert", "vocab_size": vocab, "n_embd": 128,
        "n_head": 4, "n_layer": 2, "n_inner": 128, "n_positions": 8192, "max_trained_positions": 2048,
        "type_vocab_size": 2, "layer_norm_epsilon": 1e-12, "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "activation_function": "swiglu",
        "prenorm": False, "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "causal": False,
        "pad_token_id": 0, "torch_dtype": "float32",
        # llama.cpp's converter reads the config through transformers, whose NomicBertConfig takes
        # only these names (nomic-embed-text's own dimensions are its defaults)
        "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}))
    for folder in (ours, hub):
        write_modules(folder, 128, "mean", True, max_seq_length=512)
    return ours, hub


def save_modernbert(directory: Path, seed: int = 0) -> Path:
    """A random ModernBERT (global and sliding layers, a window that bites on the tests' texts,
    no norm biases) as a sentence-transformers folder: mean pooling, normalized, BERT's tokenizer."""
    _save_encoder_tokenizer(directory, "bert")
    vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(seed)
    config = transformers.ModernBertConfig(  # head_dim 32: the CPU kernels' rotary runs it
        vocab_size=vocab, hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=512, local_attention=8, global_attn_every_n_layers=3, initializer_range=0.2,
        pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3)
    transformers.ModernBertModel(config).float().save_pretrained(directory)
    write_modules(directory, 128, "mean", True, max_seq_length=512)
    return directory


# Qwen3-Reranker's template: the pair under the system's instruction, then the assistant's turn
# with empty thinking, after which the model's next token is "yes" or "no"
RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Instruct>: "
    "{{ messages | selectattr('role', 'eq', 'system') | map(attribute='content') | first "
    "| default('Given a web search query, retrieve relevant passages that answer the query') }}\n"
    "<Query>: {{ messages | selectattr('role', 'eq', 'query') | map(attribute='content') | first }}\n"
    "<Document>: {{ messages | selectattr('role', 'eq', 'document') | map(attribute='content') | first }}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def save_causal_reranker(directory: Path, prompt: str | None = None, false_token: bool = True, seed: int = 0) -> Path:
    """A random Qwen3 language model as Qwen3-Reranker ships for sentence-transformers 6, saved by
    sentence-transformers itself: a text-generation Transformer, then a LogitScore module on the
    "yes" and (where asked) "no" tokens, the template above; `prompt` the default instruction."""
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.cross_encoder.modules import LogitScore

    base = directory / "base"
    save_byte_level(base, chat_template=RERANKER_TEMPLATE)
    settings_path = base / "tokenizer_config.json"
    tokenizer_settings = json.loads(settings_path.read_text())
    tokenizer_settings["eos_token"] = tokenizer_settings["eos_token"]["content"]
    settings_path.write_text(json.dumps(tokenizer_settings))
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        initializer_range=0.1, tie_word_embeddings=True))
    model.float().save_pretrained(base)
    yes, no = tokenizer.encode("yes").ids[0], tokenizer.encode("no").ids[0]
    prompts = {"web": prompt} if prompt else None
    reranker = CrossEncoder(modules=[Transformer(str(base), transformer_task="text-generation"),
                                     LogitScore(yes, no if false_token else None)],
                            prompts=prompts, default_prompt_name="web" if prompt else None)
    reranker.save(str(directory / "model"))
    return directory / "model"
