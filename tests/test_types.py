"""mypy, strict, over the project's own packages: ``[tool.mypy]`` in pyproject.toml says what is
checked and how (``mypy`` with no arguments in the repository root runs the same check)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import mypy.api
import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "pyproject.toml"


def test_the_packages_type_check_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the config's ``files`` are relative to the repository root
    stdout, stderr, status = mypy.api.run(["--config-file", str(CONFIG)])
    assert status == 0, f"mypy found errors:\n{stdout}{stderr}"
    # The whole tree was checked, not an empty file list (each package has several modules).
    checked = int(stdout.rsplit(" in ", 1)[1].split()[0])
    assert checked >= 90, stdout


def test_the_config_is_strict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same config rejects what strict mode exists to catch, and an untyped import not named
    # in its overrides: a check that passes everything would fail here.
    (tmp_path / "loose.py").write_text(textwrap.dedent("""\
        import not_a_module_anyone_installed

        def untyped(x):
            return x

        def wrong() -> int:
            return "text"
    """))
    monkeypatch.chdir(tmp_path)
    stdout, _, status = mypy.api.run(["--config-file", str(CONFIG), "--cache-dir",
                                      str(tmp_path / "cache"), "loose.py"])
    assert status == 1, stdout
    assert "[import-not-found]" in stdout, stdout
    assert "[no-untyped-def]" in stdout, stdout
    assert "[return-value]" in stdout, stdout
