"""ConfigHolder: reload on demand, on SIGHUP and on file change; a bad file keeps the old config."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from config import Config, ConfigError, ConfigHolder

# Hang guard for waits on a reload the code under test must do; reaching it is a failure.
GUARD_S = 5.0

GOOD = "default_agent: a\nagents:\n  a:\n    greeting: {greeting}\n    llm: {{provider: scripted}}\n"
BAD = (
    "default_agent: a\nagents:\n  a:\n    greeting: hi\n    llm: {provider: scripted}\n"
    "    barge_in: {commit_ms: soon}\n"
)


def write(path: Path, text: str) -> None:
    # Replace, as editors and ConfigMaps do: a new inode, so the change is seen whatever the
    # file system's mtime resolution.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    p = tmp_path / "agents.yaml"
    write(p, GOOD.format(greeting="one"))
    return p


def greeting(holder: ConfigHolder) -> str | None:
    return holder.current.agents["a"].greeting


def test_bad_file_at_start_raises(tmp_path: Path) -> None:
    p = tmp_path / "agents.yaml"
    write(p, BAD)
    with pytest.raises(ConfigError):
        ConfigHolder(p, env={})


def test_good_file_switches_and_notifies(path: Path) -> None:
    holder = ConfigHolder(path, env={})
    seen: list[Config] = []
    holder.on_change(seen.append)
    write(path, GOOD.format(greeting="two"))
    assert holder.reload() is True
    assert greeting(holder) == "two"
    assert seen == [holder.current]


def test_bad_file_keeps_the_old_config_and_logs(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder = ConfigHolder(path, env={})
    old = holder.current
    seen: list[Config] = []
    holder.on_change(seen.append)
    write(path, BAD)
    with caplog.at_level(logging.ERROR, logger="callgate.config"):
        assert holder.reload() is False
    assert holder.current is old
    assert seen == []
    [record] = [r for r in caplog.records if r.name == "callgate.config"]
    assert "keeping the previous config" in record.getMessage()
    assert f"{path}:6:" in record.getMessage()
    assert "agents.a.barge_in.commit_ms" in record.getMessage()


def test_missing_file_keeps_the_old_config(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = ConfigHolder(path, env={})
    path.unlink()
    with caplog.at_level(logging.ERROR, logger="callgate.config"):
        assert holder.reload() is False
    assert greeting(holder) == "one"
    assert "file not found" in caplog.text


def test_unchanged_file_does_not_notify(path: Path) -> None:
    holder = ConfigHolder(path, env={})
    seen: list[Config] = []
    holder.on_change(seen.append)
    assert holder.reload() is False
    assert seen == []


def test_unsubscribe_and_failing_listener(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = ConfigHolder(path, env={})
    seen: list[str | None] = []
    removed: list[Config] = []

    def broken(cfg: Config) -> None:
        raise RuntimeError("listener bug")

    holder.on_change(broken)
    holder.on_change(lambda cfg: seen.append(cfg.agents["a"].greeting))
    unsubscribe = holder.on_change(removed.append)
    unsubscribe()
    write(path, GOOD.format(greeting="two"))
    with caplog.at_level(logging.ERROR, logger="callgate.config"):
        assert holder.reload() is True
    assert seen == ["two"]
    assert removed == []
    assert "listener" in caplog.text and "listener bug" in caplog.text


def test_env_is_used_on_every_load(tmp_path: Path) -> None:
    p = tmp_path / "agents.yaml"
    write(p, GOOD.format(greeting="${GREETING}"))
    env = {"GREETING": "first"}
    holder = ConfigHolder(p, env=env)
    env["GREETING"] = "second"
    assert holder.reload() is True
    assert greeting(holder) == "second"


async def wait_for(predicate: object) -> None:
    async def poll() -> None:
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), GUARD_S)


async def test_watch_reloads_on_file_change(path: Path) -> None:
    holder = ConfigHolder(path, env={})
    changed = asyncio.Event()
    holder.on_change(lambda cfg: changed.set())
    task = asyncio.create_task(holder.watch(0.01))
    try:
        await asyncio.sleep(0.03)
        assert greeting(holder) == "one"  # no change, no reload
        write(path, GOOD.format(greeting="two"))
        await asyncio.wait_for(changed.wait(), GUARD_S)
        assert greeting(holder) == "two"
        write(path, BAD)
        await wait_for(lambda: not holder.changed_on_disk())
        assert greeting(holder) == "two"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_watch_rejects_a_bad_interval(path: Path) -> None:
    holder = ConfigHolder(path, env={})
    with pytest.raises(ValueError):
        await holder.watch(0)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGHUP is Unix-only")
async def test_sighup_reloads(path: Path) -> None:
    holder = ConfigHolder(path, env={})
    changed = asyncio.Event()
    holder.on_change(lambda cfg: changed.set())
    holder.install_sighup(asyncio.get_running_loop())
    try:
        write(path, GOOD.format(greeting="two"))
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.wait_for(changed.wait(), GUARD_S)
        assert greeting(holder) == "two"
    finally:
        holder.remove_sighup()
