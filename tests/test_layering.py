"""The import rules of docs/architecture.md ("Layers"), as import-linter contracts in
pyproject.toml ``[tool.importlinter]``: the tree keeps them, and a broken one fails by name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["audio", "gateway", "vad", "nodes", "config", "bus", "speech", "linesim", "bench"]


def _lint_imports(cwd: Path, *, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None, "lint-imports is missing: pip install -e '.[test]'"
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([exe, "--no-cache", "--no-logo", "pyproject.toml"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_tree_keeps_the_import_rules() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, f"an import rule is broken:\n{result.stdout}{result.stderr}"
    assert "4 kept, 0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("module", "imports", "rule"),
    [
        ("audio/_bad.py", "import gateway", "audio/ imports none of the project's packages"),
        ("gateway/_bad.py", "from nodes import _x", "gateway/ and nodes/ meet only through the bus"),
        ("speech/_bad.py", "import vad", "packages stack in layers"),
        ("config/_bad.py", "import gateway", "never import gateway/"),
    ],
)
def test_a_broken_rule_fails_by_name(tmp_path: Path, module: str, imports: str, rule: str) -> None:
    # The project's own contracts over a tree of empty packages with one import that breaks one.
    for name in PACKAGES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "nodes" / "_x.py").write_text("")
    (tmp_path / "linesim" / "cli.py").write_text("")
    # The command-line layer's own imports, which the contracts allow by name.
    (tmp_path / "gateway" / "cli.py").write_text("import linesim.cli\nimport nodes\n")
    (tmp_path / "gateway" / "launch.py").write_text("import nodes\n")
    (tmp_path / module).write_text(imports + "\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    result = _lint_imports(tmp_path, pythonpath=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    broken = [line for line in result.stdout.splitlines() if " BROKEN" in line]
    assert len(broken) >= 1 and any(rule in line for line in broken), result.stdout
    importer = module.removesuffix(".py").replace("/", ".")
    assert f"{importer} -> " in result.stdout, result.stdout
