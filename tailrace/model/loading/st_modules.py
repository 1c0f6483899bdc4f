"""A sentence-transformers folder's modules (modules.json) as sentence-transformers lists them:
each module's kind (the class name, under the module paths of every release:
`sentence_transformers.models.Pooling`, `sentence_transformers.sentence_transformer.modules.pooling.Pooling`)
and its folder; its Dense modules (their weights' files and activations), which run in the engine
after pooling; and a LogitScore module's tokens, whose logits a causal reranker's score is made of.
Without PyTorch: the API process reads these too."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_PREFIX = "sentence_transformers."
# A Dense module's activation (by its class path) -> the function the engine applies
DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}
_DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"  # the Dense module's own default


@dataclass(frozen=True, slots=True)
class StModule:
    kind: str  # "Transformer", "Pooling", "Dense", "Normalize", "LogitScore", or a foreign module's full type
    path: Path  # its folder


@dataclass(frozen=True, slots=True)
class DenseModule:
    weights: Path  # its model.safetensors: linear.weight [out, in], and linear.bias where it has one
    activation: str  # a DENSE_ACTIVATIONS value


def st_modules(root: Path) -> list[StModule]:
    """The folder's modules in order; [] without modules.json."""
    path = root / "modules.json"
    if not path.is_file():
        return []
    listed = json.loads(path.read_text(encoding="utf-8"))
    return [StModule(_kind(m.get("type", "")), root / m.get("path", "")) for m in listed]


def _kind(module_type: str) -> str:
    return module_type.rsplit(".", 1)[-1] if module_type.startswith(_PREFIX) else module_type


def dense_modules(model_path: str) -> list[DenseModule]:
    """The folder's Dense modules in order; ValueError for an activation or a layout that cannot
    be served."""
    layers = []
    for module in st_modules(Path(model_path)):
        if module.kind != "Dense":
            continue
        config = json.loads((module.path / "config.json").read_text(encoding="utf-8"))
        activation = config.get("activation_function", _DEFAULT_ACTIVATION)
        if activation not in DENSE_ACTIVATIONS:
            raise ValueError(f"{module.path}: the Dense activation {activation!r} cannot be served; supported: "
                             f"{', '.join(DENSE_ACTIVATIONS)}")
        if config.get("use_residual"):
            raise ValueError(f"{module.path}: a Dense module with use_residual cannot be served")
        weights_path = module.path / "model.safetensors"
        if not weights_path.is_file():
            raise ValueError(f"{module.path}: no model.safetensors (a Dense module's weights are read from "
                             "safetensors only)")
        layers.append(DenseModule(weights_path, DENSE_ACTIVATIONS[activation]))
    return layers


def logit_score_tokens(model_path: str) -> tuple[int, int | None] | None:
    """A LogitScore module's (true token, false token or None): the score is the last token's
    logit of the first less that of the second; None where the folder has no such module."""
    module = next((m for m in st_modules(Path(model_path)) if m.kind == "LogitScore"), None)
    if module is None:
        return None
    config = json.loads((module.path / "config.json").read_text(encoding="utf-8"))
    if config.get("module_input_name", "causal_logits") != "causal_logits":
        raise ValueError(f"{module.path}: a LogitScore module reading {config['module_input_name']!r} cannot be "
                         "served; it reads the language model's logits (causal_logits)")
    return int(config["true_token_id"]), (None if config.get("false_token_id") is None
                                          else int(config["false_token_id"]))
