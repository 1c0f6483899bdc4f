"""Every environment variable is read in tailrace/envs.py and documented in one table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tailrace import envs

ROOT = Path(__file__).resolve().parent.parent


def test_no_module_but_envs_reads_the_environment():
    readers = [str(path.relative_to(ROOT)) for pattern in ("*.py", "*.cpp", "*.h")
               for path in (ROOT / "tailrace").rglob(pattern)
               if path.name != "envs.py" and re.search(r"os\.environ|getenv\(", path.read_text())]
    assert readers == []


def test_every_variable_the_code_names_is_declared():
    named = {name for path in (ROOT / "tailrace").rglob("*.py")
             for name in re.findall(r'envs\.\w+\("([A-Z_0-9]+)"', path.read_text())}
    assert named and named <= set(envs.VARIABLES)


def test_the_documented_table_is_the_declared_one():
    assert envs.table() in (ROOT / "docs" / "architecture.md").read_text()


def test_a_value_outside_a_variables_choices_is_refused(monkeypatch):
    monkeypatch.setenv("TAILRACE_CPU_KERNELS", "yes")
    with pytest.raises(ValueError, match="TAILRACE_CPU_KERNELS='yes' is not one of 1, 0, avx2"):
        envs.get("TAILRACE_CPU_KERNELS")


def test_unset_variables_read_as_their_defaults(monkeypatch):
    monkeypatch.delenv("TAILRACE_TRITON_OPS", raising=False)
    monkeypatch.delenv("TAILRACE_API_KEY", raising=False)
    assert envs.enabled("TAILRACE_TRITON_OPS") and envs.optional("TAILRACE_API_KEY") is None
    monkeypatch.setenv("TAILRACE_TRITON_OPS", "0")
    assert not envs.enabled("TAILRACE_TRITON_OPS")


def test_path_prepended_restores_path(monkeypatch):
    monkeypatch.setenv("PATH", "/a")
    with envs.path_prepended("/b"):
        assert envs.environment()["PATH"].split(":") == ["/b", "/a"]
    assert envs.environment()["PATH"] == "/a"
