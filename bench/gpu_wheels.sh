#!/usr/bin/env bash
# Download, here, the wheels that bench/gpu.sh installs on the lent GPU machine, where nothing can
# be downloaded. Run from anywhere; they land in .whl/ at the repository's root (git-ignored), and
# the device tool's call carries them (carry [".whl"]).
#
# The list: what tailrace and `tailrace bench` import, and what those need in turn, less what the
# GPU machine's image already has (the device docs' package list, 2026-11: torch, triton,
# transformers, safetensors, tokenizers, numpy, jinja2, prometheus-client, httpx, tqdm, matplotlib,
# anyio, h11, click, annotated-doc are there; gguf is not, and the loader imports it).
# typing-extensions is there too, but pydantic 2.14 needs >= 4.16, which the image may predate.
# Versions are .venv's, which pyproject.toml pins.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(fastapi starlette opentelemetry-api uvicorn pydantic pydantic-core annotated-types typing-inspection
          typing-extensions msgspec orjson llguidance gguf)
# pip matches each manylinux tag exactly, so name every glibc the image's (Python 3.12.3's) admits
# that a wheel here uses: llguidance's is 2_31.
PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64
           manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

pins=()
for name in "${PACKAGES[@]}"; do
    pins+=("$name==$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done

rm -rf .whl
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d .whl "${pins[@]}"

# What each wheel needs, to check by eye against the list above (extras left out).
for wheel in .whl/*.whl; do
    needs=$(unzip -p "$wheel" '*.dist-info/METADATA' | sed -n '/extra ==/d; s/^Requires-Dist: //p' | paste -sd ';' -)
    echo "$(basename "$wheel")  needs: ${needs:-nothing}"
done
echo "$(ls .whl/*.whl | wc -l) wheels, $(du -ch .whl/*.whl | tail -1 | cut -f1) in .whl/"
