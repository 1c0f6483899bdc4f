"""llama.cpp's `llama-server`, built from source, serving the model converted to GGUF.

No registry ships a prebuilt server, but the `llama-cpp-python` source distribution carries the
whole llama.cpp tree (vendor/llama.cpp). From it: cmake builds `llama-server` and `llama-quantize`
(about 10 minutes on 2 cores), and its `convert_hf_to_gguf.py` turns the model directory into a
GGUF, in a small environment of its own (torch, numpy, sentencepiece, transformers and the tree's
gguf-py). GGUFs are cached per model directory contents and output type.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import tarfile
from pathlib import Path

from tailrace.bench.disk import ensure_room
from tailrace.bench.peers import PeerServer, PeerSettings, offline_env
from tailrace.bench.peers.install import is_installed, make_venv, mark_installed, start_install, step
from tailrace.bench.shapes import TOKENIZER_FILES, Shape, layer_of, repeat_layer, write_shape
from tailrace.engine.config import EMBEDDED_MODEL

NAME = "llamacpp"
VERSION = "0.3.36"  # of llama-cpp-python, whose sdist carries the llama.cpp tree
# The converter's own requirements file pins transformers 4.57.6; torch comes from the local CPU wheel.
CONVERT_REQUIREMENTS = (("torch==2.13.0",), ("numpy", "sentencepiece", "protobuf", "transformers==4.57.6"))
PINS = {"llama-cpp-python": VERSION, "convert": CONVERT_REQUIREMENTS}
CMAKE_FLAGS = ("-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")
OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}
OUTTYPE_BYTES = {"f32": 4, "bf16": 2}
QUANTS = ("Q8_0", "Q4_0")
CONVERT_WRAPPER = Path(__file__).with_name("llamacpp_convert.py")
# What converting takes from the tree.
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def tree(directory: Path) -> Path:
    return directory / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def binary(directory: Path, name: str) -> Path:
    return directory / "build" / "bin" / name


def fetch_tree(directory: Path, parts: tuple[str, ...] | None = None) -> Path:
    """llama.cpp's tree from the llama-cpp-python sdist (pip downloads it into `directory`),
    unpacked there whole or only the `parts` given (paths in the tree; a folder's ends in /)."""
    step(NAME, f"pip download llama-cpp-python=={VERSION} (source)",
         [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
          "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", str(directory)])
    print(f"{NAME}: unpacking the source", flush=True)
    root = tree(directory).relative_to(directory).as_posix()
    with tarfile.open(directory / f"llama_cpp_python-{VERSION}.tar.gz") as archive:
        members = None if parts is None else [
            m for m in archive.getmembers()
            if any(m.name == f"{root}/{part}" or m.name.startswith(f"{root}/{part}") for part in parts)]
        archive.extractall(directory, members=members, filter="data")
    return tree(directory)


# The architectures whose multi-token-prediction layers the converter writes, and expects
MTP_ARCHITECTURES = {"Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                     "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM"}


def convert_command(tree_dir: Path, model_dir: Path, outtype: str, outfile: Path,
                    python: Path | str = sys.executable) -> list[str]:
    """llama.cpp's converter turning `model_dir` into `outfile` (outtype f32, bf16, ...) under
    `python`, which has its requirements (torch, numpy, sentencepiece, transformers, safetensors);
    told to expect no multi-token-prediction layers where the architecture has them and the
    checkpoint does not (a random one that transformers wrote)."""
    config = json.loads((model_dir / "config.json").read_text())
    without_mtp = (bool(MTP_ARCHITECTURES.intersection(config.get("architectures", [])))
                   and not any(name.startswith(("mtp.", "model.mtp.")) for name in tensor_shapes(model_dir)))
    return [str(python), str(CONVERT_WRAPPER), str(tree_dir), str(model_dir), "--outtype", outtype,
            "--outfile", str(outfile), *(["--no-mtp"] if without_mtp else [])]


def tensor_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Each tensor the safetensors files of `model_dir` hold, by name, with its shape (read from
    their headers)."""
    from safetensors import safe_open

    shapes = {}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as weights:
            shapes |= {name: weights.get_slice(name).get_shape() for name in weights.keys()}
    return shapes


def ensure_installed(directory: Path) -> None:
    if is_installed(directory, PINS):
        return
    start_install(directory)
    fetch_tree(directory)
    step(NAME, "cmake configure", ["cmake", "-S", str(tree(directory)), "-B", str(directory / "build"), *CMAKE_FLAGS])
    step(NAME, "cmake build llama-server llama-quantize (about 10 minutes on 2 cores)",
         ["cmake", "--build", str(directory / "build"), "--target", "llama-server", "llama-quantize", "-j2"])
    make_venv(NAME, directory / "convert-venv", (*CONVERT_REQUIREMENTS, (str(tree(directory) / "gguf-py"),)))
    mark_installed(directory, PINS)


def model_key(model_dir: Path) -> str:
    """Names the model directory's contents: file names, sizes and modification times (a snapshot
    copied with its times keeps the key of its source, so a copy is converted once)."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.iterdir() if p.is_file())
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]


def gguf_path(directory: Path, model_dir: Path, kind: str) -> Path:
    return directory / "gguf" / f"{model_dir.name}-{model_key(model_dir)}-{kind}.gguf"


def weight_count(model_dir: Path) -> int:
    """How many numbers the safetensors files of `model_dir` hold."""
    return sum(math.prod(shape) for shape in tensor_shapes(model_dir).values())


def ensure_gguf(directory: Path, model_dir: Path, dtype: str, quant: str | None, pure: bool = False) -> Path:
    """The model as GGUF at `dtype`, quantized to `quant` from there when given (`pure`: every
    matrix, the output one too, which llama-quantize otherwise keeps at Q6_K); made once."""
    outtype = OUTTYPES[dtype]
    converted = gguf_path(directory, model_dir, outtype)
    if not converted.exists():
        converted.parent.mkdir(exist_ok=True)
        partial = converted.with_suffix(".partial")
        ensure_room(partial, OUTTYPE_BYTES[outtype] * weight_count(model_dir), converted.name)
        step(NAME, f"converting {model_dir} to {converted.name}",
             convert_command(tree(directory), model_dir, outtype, partial,
                             directory / "convert-venv" / "bin" / "python"))
        partial.rename(converted)  # only a whole file counts as cached
    if quant is None:
        return converted
    quantized = gguf_path(directory, model_dir, f"{outtype}-{quant}{'-pure' if pure else ''}")
    if not quantized.exists():
        partial = quantized.with_suffix(".partial")
        ensure_room(partial, converted.stat().st_size, quantized.name)  # at most the unquantized file's size
        step(NAME, f"quantizing to {quant}",
             [str(binary(directory, "llama-quantize")), *(["--pure"] if pure else []), str(converted), str(partial),
              quant])
        partial.rename(quantized)
    return quantized


def shape_dir(directory: Path, shape: Shape) -> Path:
    """The shape written (shapes.write_shape) with its tokenizer: the embedded model's, or the real
    vocabulary it names from this tree (vocabulary_tokenizer)."""
    source = vocabulary_tokenizer(directory, shape.vocabulary) if shape.vocabulary else Path(EMBEDDED_MODEL)
    return write_shape(shape, tokenizer_dir=str(source))


def vocabulary_tokenizer(directory: Path, name: str) -> Path:
    """A tokenizer folder of the real vocabulary models/ggml-vocab-NAME.gguf in llama.cpp's tree
    (its tokenizer.json rebuilt by tailrace's GGUF tokenizer; its bos, eos and pad ids in
    config.json and generation_config.json), which llama.cpp's converter reads as that family's
    own; made once."""
    from tailrace.model.loading.gguf_file import metadata, open_gguf
    from tailrace.model.loading.gguf_tokenizer import build_tokenizer

    target = directory / "vocabularies" / name
    if all((target / file).exists() for file in TOKENIZER_FILES):
        return target
    vocab = tree(directory) / "models" / f"ggml-vocab-{name}.gguf"
    if not vocab.exists():
        fetch_tree(directory, ("models/",))
    reader = open_gguf(str(vocab))
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    ids = {key: metadata(reader, f"tokenizer.ggml.{key}_token_id", None) for key in ("bos", "eos", "padding")}
    special = {f"{key}_token": tokens[i] for key, i in (("bos", ids["bos"]), ("eos", ids["eos"]),
                                                        ("pad", ids["padding"])) if i is not None}
    partial = target.with_name(f"{name}.partial")
    partial.mkdir(parents=True, exist_ok=True)
    build_tokenizer(reader).save(str(partial / "tokenizer.json"))
    numbers = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["padding"]}
    files = {"tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, **special},
             "special_tokens_map.json": special, "config.json": numbers, "generation_config.json": numbers}
    for file, content in files.items():
        (partial / file).write_text(json.dumps(content, indent=2) + "\n")
    partial.rename(target)  # only a whole folder counts as made
    return target


def repeated_layer_gguf(directory: Path, shape: Shape, dtype: str, quant: str | None) -> Path:
    """The GGUF of a shape written as one layer (Shape.one_layer): that layer written, converted
    (and quantized), then repeated for every layer of the shape; made once. Quantized `pure`: a
    Q6_K head would be dequantized and requantized by tailrace, a transient of several GB at the
    end of a load that already fills most of a 24 GB machine. Not MXFP4_MOE, whose mix (experts
    MXFP4, every other matrix Q8_0) tailrace takes block for block, and --pure would make MXFP4 all."""
    pure = quant is not None and quant != "MXFP4_MOE"
    layer = ensure_gguf(directory, shape_dir(directory, layer_of(shape)), dtype, quant, pure=pure)
    target = layer.with_name(f"{shape.name}-{layer.stem.removeprefix(layer_of(shape).name + '-')}.gguf")
    if not target.exists():
        partial = target.with_suffix(".partial")
        print(f"{NAME}: repeating {layer.name}'s layer {shape.num_hidden_layers} times into {target.name}", flush=True)
        repeat_layer(layer, shape.num_hidden_layers, partial)
        partial.rename(target)
    return target


def launch(directory: Path, settings: PeerSettings) -> PeerServer:
    model = Path(settings.model_dir)
    gguf = model if model.suffix == ".gguf" else ensure_gguf(directory, model, settings.dtype, settings.quant)
    # -np slots share the context -c, so each slot gets max_model_len tokens; --jinja applies the
    # chat template the converter copied into the GGUF.
    command = [str(binary(directory, "llama-server")), "-m", str(gguf), "--host", "127.0.0.1",
               "--port", str(settings.port), "-np", str(settings.max_num_seqs),
               "-c", str(settings.max_num_seqs * settings.max_model_len), "-t", str(settings.threads),
               "--jinja", "--alias", gguf.stem, *settings.llamacpp_args]
    return PeerServer(command, offline_env(), model=gguf.stem)
