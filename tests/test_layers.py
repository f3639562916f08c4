"""The packages' layering contract (``[tool.importlinter]`` in pyproject.toml, checked by
import-linter) holds, names every module of ``shared/``, and catches an import that
points up or across."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shared", "engine_proc", "frontend")
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True))")


def _lint(packages_root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the packages under ``packages_root`` with the project's contract."""
    return subprocess.run([sys.executable, "-c", LINT, str(ROOT / "pyproject.toml")], cwd=packages_root,
                          env={**os.environ, "PYTHONPATH": str(packages_root)}, capture_output=True, text=True,
                          timeout=120)


def test_the_layering_contract_holds():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_every_module_of_shared_has_its_layer():
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    named = set(re.findall(r"shared\.\w+", " ".join(contract["layers"])))
    modules = {f"shared.{f.stem}" for f in (ROOT / "shared").glob("*.py") if f.stem != "__init__"}
    modules |= {f"shared.{d.name}" for d in (ROOT / "shared").iterdir() if (d / "__init__.py").exists()}
    assert modules - named == set(), "place these modules in a layer of [tool.importlinter]"
    assert named - modules == set(), "the contract names modules that do not exist"


VIOLATIONS = [
    ("shared.shm", "engine_proc.kernels.build"),  # the bottom reaching up
    ("shared.protocol", "shared.cli"),  # the bottom reaching the launcher
    ("engine_proc.scheduler", "frontend.schemas"),  # across: the engine and the frontend are independent
    ("frontend.server", "shared.cli"),  # the middle reaching the launcher
]


def test_the_contract_catches_imports_that_point_up_or_across(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "static", "*.c"))
    for importer, imported in VIOLATIONS:
        with open(tmp_path / (importer.replace(".", "/") + ".py"), "a") as f:
            f.write(f"\nimport {imported}  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for importer, imported in VIOLATIONS:
        assert f"{importer} -> {imported}" in result.stdout, result.stdout
