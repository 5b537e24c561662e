"""What a reload reports: which settings need a restart, refusals by a check, SIGHUP's result."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from config import DEFAULT_CONFIG, RESTART_REQUIRED, ConfigHolder, ReloadResult


def _write(path: Path, **server: Any) -> None:
    cfg = yaml.safe_load(Path(DEFAULT_CONFIG).read_text())
    cfg["server"] = {**cfg["server"], **server}
    path.write_text(yaml.safe_dump(cfg))


def test_a_reload_says_which_changes_need_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="callgate.config")
    path = tmp_path / "agents.yaml"
    _write(path)
    holder = ConfigHolder(path, env={})
    seen: list[int] = []
    holder.on_change(lambda cfg: seen.append(cfg.server.max_calls))
    _write(path, max_calls=5, port=9090, host="127.0.0.1")
    result = holder.reload_report()
    assert result == ReloadResult(changed=True, restart_required=("server.host", "server.port"))
    assert holder.last_reload == result
    assert seen == [5]  # the rest is in force
    assert holder.current.server.port == 9090  # as the file says; the process binds once
    assert "take effect only after a restart: server.host, server.port" in caplog.text
    _write(path, max_calls=6, port=9090, host="127.0.0.1")
    assert holder.reload_report() == ReloadResult(changed=True)
    assert holder.reload_report() == ReloadResult(changed=False)  # unchanged
    assert set(RESTART_REQUIRED) == {"server.host", "server.port", "bus.redis_url"}


def test_a_check_refuses_a_reload_whole(tmp_path: Path) -> None:
    path = tmp_path / "agents.yaml"
    _write(path)
    holder = ConfigHolder(path, env={})

    def no_tiny_gateways(cfg: Any) -> None:
        if cfg.server.max_calls < 10:
            raise ValueError("max_calls under 10 is refused here")

    remove = holder.add_check(no_tiny_gateways)
    _write(path, max_calls=5)
    result = holder.reload_report()
    assert not result.changed and result.error == "max_calls under 10 is refused here"
    assert holder.current.server.max_calls == 200
    assert holder.reload() is False  # the bool form says the same
    remove()
    assert holder.reload() is True and holder.current.server.max_calls == 5


async def test_sighup_reloads_and_keeps_the_result(tmp_path: Path) -> None:
    path = tmp_path / "agents.yaml"
    _write(path)
    holder = ConfigHolder(path, env={})
    done = asyncio.Event()
    holder.on_change(lambda cfg: done.set())
    holder.install_sighup()
    try:
        _write(path, max_calls=11)
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.wait_for(done.wait(), 30)
    finally:
        holder.remove_sighup()
    assert holder.last_reload == ReloadResult(changed=True)
    assert holder.current.server.max_calls == 11
