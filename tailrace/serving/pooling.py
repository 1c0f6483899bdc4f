"""How an embedding model turns its hidden states into one vector, read once from its folder the
way sentence-transformers reads it: modules.json lists a Transformer, then a Pooling module (whose
config.json names the mode) and optionally a Normalize module. A model without modules.json
served with --task embed pools its last token and normalizes, as vLLM does for decoder models."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tailrace.model.decoder import registry
from tailrace.tokenizer import read_json

# sentence-transformers' Pooling config key -> the engine's method (SamplingParams.pooling)
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST = "sentence_transformers.models."


@dataclass(frozen=True, slots=True)
class Pooling:
    method: str  # "last", "mean" or "cls": which hidden states make the vector
    normalize: bool  # to unit length (sentence-transformers' Normalize module)
    matryoshka: bool = False  # trained so that a prefix of the vector is an embedding too (`dimensions`)
    # config_sentence_transformers.json's prompts by name ("query": "query: "), put before a text
    # input as sentence-transformers' encode(prompt_name=...) puts them; the default applies unasked
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None

    def describe(self) -> str:
        return {"last": "the last token's", "mean": "the mean of the tokens'", "cls": "the first token's"}[
            self.method] + " hidden state" + (", normalized" if self.normalize else "")


TASKS = ("auto", "generate", "embed")


def resolve_task(option: str, model_path: str) -> tuple[Pooling | None, str]:
    """What the server serves (`--task`): None to generate, else how it pools; and one line that
    says which and why. auto embeds a sentence-transformers folder and a base model (Qwen3Model:
    no language-model head), and generates with anything else."""
    root = Path(model_path)
    pooling_modules = any(m.get("type") == _ST + "Pooling" for m in _modules(root))
    base = _base_model_class(root)
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
    modules = _modules(root)
    matryoshka = _is_matryoshka(root)
    prompts, default_prompt = _prompts(root)
    if not modules:
        return Pooling("last", True, matryoshka, prompts, default_prompt)
    kinds = {module.get("type", "").removeprefix(_ST): module for module in modules}
    unknown = [kind for kind in kinds if kind not in ("Transformer", "Pooling", "Normalize")]
    if unknown:
        raise ValueError(f"{root / 'modules.json'}: the module {kinds[unknown[0]].get('type')!r} cannot be served; "
                         "supported: Transformer, Pooling, Normalize")
    if "Pooling" not in kinds:
        raise ValueError(f"{root / 'modules.json'} lists no Pooling module")
    settings = read_json(root / kinds["Pooling"].get("path", "") / "config.json")
    method = _pooling_method(settings)
    if not settings.get("include_prompt", True) and method != "last":
        raise ValueError("the Pooling module leaves the prompt's tokens out (include_prompt false), which cannot "
                         "be served")
    normalize = "Normalize" in kinds
    return Pooling(method, normalize, matryoshka, prompts, default_prompt)


def _base_model_class(root: Path) -> str | None:
    names = read_json(root / "config.json").get("architectures") or [""]
    return names[0] if registry.is_base_model(names[0]) else None


def _modules(root: Path) -> list[dict]:
    return read_json(root / "modules.json") or []


def _pooling_method(config: dict) -> str:
    on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if len(on) != 1 or on[0] not in _MODES:
        raise ValueError(f"the Pooling module turns on {', '.join(on) or 'no mode'}; one of {', '.join(_MODES)}, "
                         "alone, can be served")
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
