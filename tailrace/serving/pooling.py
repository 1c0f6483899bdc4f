"""How an embedding model turns its hidden states into one vector, read once from its folder the
way sentence-transformers reads it: modules.json lists a Transformer, then a Pooling module (whose
config.json names the mode), Dense modules (which the engine runs after pooling:
model/loading/st_modules.py) and optionally a Normalize module. A model without modules.json
served with --task embed pools its last token and normalizes, as vLLM does for decoder models.
A cross-encoder scores pairs: a sequence classifier on its first token, or a causal language
model whose Transformer module is followed by a LogitScore module (Qwen3-Reranker), on the last
token's logits of a "yes" and a "no" token over its chat template's rendering of the pair."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tailrace.model.decoder import registry
from tailrace.model.decoder.config import num_labels
from tailrace.model.loading import gguf_file
from tailrace.model.loading.hub import is_gguf
from tailrace.model.loading.st_modules import StModule, st_modules
from tailrace.tokenizer import read_json

# sentence-transformers' Pooling config key -> the engine's method (SamplingParams.pooling)
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_NAMED_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}  # sentence-transformers 6's pooling_mode
_ORDER = ("Transformer", "Pooling", "Dense", "Normalize")  # the modules served, in the order they run
# llama.cpp's pooling_type (a GGUF's {arch}.pooling_type) -> the engine's method
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


@dataclass(frozen=True, slots=True)
class Pooling:
    method: str  # "last", "mean" or "cls": which hidden states make the vector
    normalize: bool  # to unit length (sentence-transformers' Normalize module)
    matryoshka: bool = False  # trained so that a prefix of the vector is an embedding too (`dimensions`)
    # config_sentence_transformers.json's prompts by name ("query": "query: "), put before a text
    # input as sentence-transformers' encode(prompt_name=...) puts them; the default applies unasked
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    # A cross-encoder's (method "score" or "logits"): a pair's score is its classifier's output
    # through this, "sigmoid" or "identity", as sentence-transformers' CrossEncoder applies it;
    # None: an embedding model, whose scores are cosines
    score_activation: str | None = None
    dense: int = 0  # sentence-transformers Dense modules after pooling (run in the engine)
    # method "logits": the keyword arguments its Transformer module gives the chat template
    # (sentence_bert_config.json's processing_kwargs.chat_template, add_generation_prompt among them)
    template_settings: dict = field(default_factory=dict)

    def describe(self) -> str:
        if self.method == "logits":
            return (f"each pair as its chat template renders it, the last token's logit score, through "
                    f"{self.score_activation}")
        if self.score_activation is not None:
            return f"each pair's classifier output on its first token, through {self.score_activation}"
        return ({"last": "the last token's", "mean": "the mean of the tokens'", "cls": "the first token's"}[self.method]
                + " hidden state" + (f", through {self.dense} Dense module(s)" if self.dense else "")
                + (", normalized" if self.normalize else ""))


TASKS = ("auto", "generate", "embed", "score")
# sentence-transformers' CrossEncoder activation (config.json's, by its class path) -> Pooling.score_activation
_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity"}


def resolve_task(option: str, model_path: str) -> tuple[Pooling | None, str]:
    """What the server serves (`--task`): None to generate, else how it pools; and one line that
    says which and why. auto embeds a sentence-transformers folder and a base model (Qwen3Model,
    BertModel: no language-model head), scores pairs with a sequence classifier (a cross-encoder),
    and generates with anything else."""
    root = Path(model_path)
    embedder = gguf_embedding_pooling(model_path) if is_gguf(model_path) else None
    if embedder is not None:
        if option in ("generate", "score"):
            raise ValueError(f"this GGUF is an embedding model: it embeds and cannot {option}; serve it with "
                             "--task embed or auto")
        return embedder, f"task: embed (a GGUF embedding model): {embedder.describe()}"
    name = _class_name(root)
    kinds = {m.kind for m in st_modules(root)}
    if "LogitScore" in kinds:
        if option in ("generate", "embed"):
            raise ValueError(f"this folder is a reranker (a LogitScore module): it scores pairs (/v1/score, "
                             f"/v1/rerank) and cannot {option}; serve it with --task score or auto")
        pooling = read_logit_scorer(model_path)
        return pooling, f"task: score ({name} with LogitScore): {pooling.describe()}"
    if registry.is_classifier(name):
        if option in ("generate", "embed"):
            raise ValueError(f"{name} is a cross-encoder: it scores pairs (/v1/score, /v1/rerank) and cannot "
                             f"{'generate' if option == 'generate' else 'embed'}; serve it with --task score or auto")
        pooling = read_cross_encoder(model_path)
        return pooling, f"task: score ({name}): {pooling.describe()}"
    if option == "score":
        raise ValueError("--task score serves a sequence classifier (a cross-encoder); this model embeds: serve it "
                         "with --task embed, and /v1/score and /v1/rerank compare its embeddings")
    pooling_modules = "Pooling" in kinds
    base = name if registry.is_base_model(name) else None
    if option == "generate" and base:
        raise ValueError(f"{base} is a base model with no language-model head: it cannot generate; serve it "
                         "with --task embed")
    if option == "generate" or (option == "auto" and not (pooling_modules or base)):
        return None, "task: generate"
    pooling = read_pooling(model_path)
    why = "--task embed" if option == "embed" else ("modules.json" if pooling_modules else f"{base} has no head")
    return pooling, f"task: embed ({why}): {pooling.describe()}"


def read_pooling(model_path: str) -> Pooling:
    """The folder's pooling; ValueError names a module or mode that cannot be served."""
    root = Path(model_path)
    modules = st_modules(root)
    matryoshka = _is_matryoshka(root)
    prompts, default_prompt = _prompts(root)
    if not modules:
        return Pooling("last", True, matryoshka, prompts, default_prompt)
    _check_modules(root, modules)
    pooling = next(m for m in modules if m.kind == "Pooling")
    settings = read_json(pooling.path / "config.json")
    method = _pooling_method(settings)
    if not settings.get("include_prompt", True) and method != "last":
        raise ValueError("the Pooling module leaves the prompt's tokens out (include_prompt false), which cannot "
                         "be served")
    normalize = any(m.kind == "Normalize" for m in modules)
    return Pooling(method, normalize, matryoshka, prompts, default_prompt,
                   dense=sum(m.kind == "Dense" for m in modules))


def _check_modules(root: Path, modules: list[StModule]) -> None:
    """Only Transformer, Pooling, Dense and Normalize modules, in that order, one Pooling."""
    unknown = [m.kind for m in modules if m.kind not in _ORDER]
    if unknown:
        raise ValueError(f"{root / 'modules.json'}: the module {unknown[0]!r} cannot be served; supported: "
                         f"{', '.join(_ORDER)}")
    kinds = [m.kind for m in modules]
    if kinds.count("Pooling") != 1:
        raise ValueError(f"{root / 'modules.json'} lists {kinds.count('Pooling') or 'no'} Pooling modules; one "
                         "can be served")
    ranks = [_ORDER.index(kind) for kind in kinds]
    if ranks != sorted(ranks):
        raise ValueError(f"{root / 'modules.json'}: the modules run in the order {', '.join(kinds)}; served: "
                         f"{', '.join(_ORDER)}")


def gguf_embedding_pooling(model_path: str) -> Pooling | None:
    """A GGUF embedding model's pooling (an encoder's, or EmbeddingGemma's), as its metadata names
    it (llama.cpp's pooling_type), normalized as llama.cpp's server normalizes its embeddings;
    None for any other GGUF."""
    reader = gguf_file.open_gguf(model_path)
    arch = gguf_file.architecture(reader)
    if not registry.gguf_embeds(arch):
        return None
    kind = gguf_file.metadata(reader, f"{arch}.pooling_type", None)
    if kind not in _GGUF_POOLING:
        raise ValueError(f"{arch}.pooling_type {kind} cannot be served; supported: "
                         + ", ".join(f"{k} ({v})" for k, v in _GGUF_POOLING.items()))
    return Pooling(_GGUF_POOLING[kind], True)


def read_cross_encoder(model_path: str) -> Pooling:
    """A sequence classifier's scoring: one label, through the activation its config.json names
    for sentence-transformers (sigmoid where it names none); ValueError for any other."""
    config = read_json(Path(model_path) / "config.json")
    labels = num_labels(config)
    if labels != 1:
        raise ValueError(f"the classifier has {labels} labels; a cross-encoder that scores pairs has one")
    return Pooling("score", False, score_activation=_score_activation(Path(model_path)))


def read_logit_scorer(model_path: str) -> Pooling:
    """A causal reranker's scoring (modules.json: a text-generation Transformer, then LogitScore):
    the pair rendered by the chat template with sentence-transformers' message roles, its prompts
    (the default one as a system message), and the activation; ValueError for any other layout."""
    root = Path(model_path)
    kinds = [m.kind for m in st_modules(root)]
    if kinds != ["Transformer", "LogitScore"]:
        raise ValueError(f"{root / 'modules.json'}: the modules run in the order {', '.join(kinds)}; a reranker "
                         "served on its logits has a Transformer, then a LogitScore module")
    settings = read_json(root / "sentence_bert_config.json")
    if settings.get("transformer_task") != "text-generation":
        raise ValueError(f"{root / 'sentence_bert_config.json'}: a LogitScore module reads a language model's "
                         f"logits; transformer_task is {settings.get('transformer_task')!r}, not 'text-generation'")
    prompts, default_prompt = _prompts(root)
    template = dict((settings.get("processing_kwargs") or {}).get("chat_template") or {})
    template.pop("restore_suffix", None)  # truncation always restores the template's tail (serving/pair_prompts.py)
    return Pooling("logits", False, prompts=prompts, default_prompt=default_prompt,
                   score_activation=_score_activation(root), template_settings=template)


def _score_activation(root: Path) -> str:
    """A cross-encoder's activation as sentence-transformers resolves it: its own config's
    (config_sentence_transformers.json), else the model config's, else sigmoid (one label)."""
    config = read_json(root / "config.json")
    path = (read_json(root / "config_sentence_transformers.json").get("activation_fn")
            or (config.get("sentence_transformers") or {}).get("activation_fn")
            or config.get("sbert_ce_default_activation_function"))
    if path is not None and path not in _ACTIVATIONS:
        raise ValueError(f"the cross-encoder's activation {path!r} cannot be served; supported: "
                         f"{', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS.get(path, "sigmoid")


def _class_name(root: Path) -> str:
    return (read_json(root / "config.json").get("architectures") or [""])[0]


def _pooling_method(config: dict) -> str:
    """The Pooling module's mode: sentence-transformers 6's `pooling_mode` (a name, or a list of
    them), or the older `pooling_mode_*` switches (none on is mean, as sentence-transformers reads
    them)."""
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
        if len(modes) != 1 or modes[0] not in _NAMED_MODES:
            raise ValueError(f"the Pooling module's pooling_mode is {config['pooling_mode']!r}; one of "
                             f"{', '.join(_NAMED_MODES)}, alone, can be served")
        return _NAMED_MODES[modes[0]]
    on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if not on:
        return "mean"
    if len(on) != 1 or on[0] not in _MODES:
        raise ValueError(f"the Pooling module turns on {', '.join(on)}; one of {', '.join(_MODES)}, alone, can be "
                         "served")
    return _MODES[on[0]]


def _prompts(root: Path) -> tuple[dict[str, str], str | None]:
    path = root / "config_sentence_transformers.json"
    config = read_json(path)
    prompts = config.get("prompts") or {}
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ValueError(f"{path}: default_prompt_name {default!r} is not among its prompts")
    return prompts, default


def _is_matryoshka(root: Path) -> bool:
    config = read_json(root / "config.json")
    return bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
