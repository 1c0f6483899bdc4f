"""The serving install is lean: what `./bin/serve` installs, and what serving imports, holds no test tool."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    for sep in "=<>;[ ":
        requirement = requirement.split(sep)[0]
    return requirement.lower().replace("_", "-")


def _test_only() -> set[str]:
    runtime = {_name(r) for r in PROJECT["dependencies"]}
    return {_name(r) for r in PROJECT["optional-dependencies"]["test"]} - runtime


def test_the_package_version_is_the_projects():
    # The API reports tailrace.__version__, which holds when a checkout runs from PYTHONPATH
    # uninstalled (the GPU machine's run); it must be the version pip installs.
    import tailrace

    assert tailrace.__version__ == PROJECT["version"]


def test_serving_dependencies_hold_no_test_tool():
    runtime = {_name(r) for r in PROJECT["dependencies"]}
    assert runtime & {"transformers", "litellm", "langchain-openai", "schemathesis", "triton", "pytest"} == set()


# Import names of the test-only distributions (the few whose import name differs from it).
_IMPORT_NAMES = {"langchain-openai": "langchain_openai"}

_BLOCKED_IMPORT = """
import importlib.abc, sys
blocked = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"test-only package imported while serving: {name}")
sys.meta_path.insert(0, Block())
import tailrace.cli, tailrace.api.app, tailrace.api.server, tailrace.engine.client, tailrace.engine.core_process
import tailrace.llm
tailrace.cli.build_parser().parse_args(["serve"])
"""


def test_serving_imports_no_test_only_package():
    blocked = {_IMPORT_NAMES.get(name, name).replace("-", "_") for name in _test_only()}
    assert "transformers" in blocked
    run = subprocess.run([sys.executable, "-c", _BLOCKED_IMPORT, ",".join(sorted(blocked))], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


_BENCH_WITHOUT_HTTPX = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "httpx":
            raise ModuleNotFoundError(name=name)
sys.meta_path.insert(0, Block())
from tailrace.cli import main
sys.exit(main(["bench", "serve"]))
"""


def test_bench_without_its_extra_says_what_to_install():
    run = subprocess.run([sys.executable, "-c", _BENCH_WITHOUT_HTTPX], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert "needs the bench extra (httpx is missing): pip install -e '.[bench]'" in run.stdout
