"""Hot reload: hold the current config and swap it when the file changes, never for a bad one.

A reload loads the whole file again. If the new file is bad the old config stays in force and the
problems are logged (logger ``callgate.config``), so a typo made while editing a live system costs
nothing. Python modules named by ``ref`` are imported once per process: a reload picks up a new
``ref``, not new code in an already imported module.

Every setting takes effect on reload except those in :data:`RESTART_REQUIRED` (what a process
binds or connects to once, at start): a reload that changes one of them still switches the
rest, and says which did not take effect, in its log line and in
:attr:`ReloadResult.restart_required`. The parts of a process that apply settings can refuse a
config before it switches (:meth:`ConfigHolder.add_check`): a reload turning signature
validation on without an auth token is refused whole, rather than half applied.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._errors import ConfigError
from ._loader import Validator, load_config, resolve_config_path
from ._schema import Config

__all__ = ["RESTART_REQUIRED", "ConfigHolder", "ReloadResult"]

logger = logging.getLogger("callgate.config")

Listener = Callable[[Config], None]
Check = Callable[[Config], None]

RESTART_REQUIRED: tuple[str, ...] = ("server.host", "server.port", "bus.redis_url")
"""Dotted fields a running process does not pick up: the gateway's listening socket is bound,
and gateways and workers connect to the bus, once, at start. Everything else (Twilio security,
``max_calls``, ``overload_lag_ms``, ``drain_timeout_s``, numbers, agents, speech) reloads."""


@dataclass(frozen=True, slots=True)
class ReloadResult:
    """What a reload did.

    Attributes:
        changed: the new config is in force (False: unchanged, or refused).
        error: why it was refused (a bad file, or a check of :meth:`ConfigHolder.add_check`),
            None otherwise.
        restart_required: fields of :data:`RESTART_REQUIRED` that changed; the rest of the new
            config is in force, these take effect only when the process restarts.
    """

    changed: bool
    error: str | None = None
    restart_required: tuple[str, ...] = ()


def _field(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _stamp(path: Path) -> tuple[int, int, int] | None:
    # Inode too: editors and Kubernetes ConfigMaps replace the file rather than write into it.
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class ConfigHolder:
    """The current config of a process, reloaded on demand, on SIGHUP or when the file changes.

    Args:
        path: The YAML file; None: ``$CALLGATE_CONFIG``, else the shipped ``config/agents.yaml``.
        env: Where ``${VAR}`` is looked up on every load; default ``os.environ``.
        validate: Run on every load (``load_config(validate=)``): a file it finds problems in
            is refused like a bad one. The processes pass ``nodes.check_agents``.

    Raises:
        ConfigError: The file is bad at construction (there is no old config to keep).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        validate: Validator | None = None,
    ) -> None:
        self._env = env
        self._validate = validate
        self.path: Path = resolve_config_path(path, env=env)
        self._stamp = _stamp(self.path)
        self._current: Config = load_config(self.path, env=env, validate=validate)
        self._listeners: list[Listener] = []
        self._checks: list[Check] = []
        self.last_reload: ReloadResult | None = None
        """The result of the latest reload (SIGHUP, the file watch or a call), None before."""
        self._sighup_loop: asyncio.AbstractEventLoop | None = None

    @property
    def current(self) -> Config:
        """The config in force."""
        return self._current

    def on_change(self, callback: Listener) -> Callable[[], None]:
        """Call ``callback(new_config)`` after each reload that switched; returns an unsubscriber.

        Callbacks run synchronously in the order added; one that raises is logged and the others
        still run (the new config is in force either way).
        """
        self._listeners.append(callback)

        def remove() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return remove

    def add_check(self, check: Check) -> Callable[[], None]:
        """Have ``check(new_config)`` vet every reload before it switches; returns a remover.

        A check that raises ``ValueError`` or :class:`ConfigError` refuses the reload (logged,
        the old config kept): for settings a part of the process cannot apply.
        """
        self._checks.append(check)

        def remove() -> None:
            if check in self._checks:
                self._checks.remove(check)

        return remove

    def reload(self) -> bool:
        """Load the file again; returns whether the config in force changed.

        A bad file is logged (with every problem, each naming its line) and the old config kept.
        An unchanged file returns False and notifies nobody. :meth:`reload_report` says more.
        """
        return self.reload_report().changed

    def reload_report(self) -> ReloadResult:
        """:meth:`reload`, returning what it did (also kept as :attr:`last_reload`)."""
        result = self._reload()
        self.last_reload = result
        return result

    def _reload(self) -> ReloadResult:
        self._stamp = _stamp(self.path)
        try:
            new = load_config(self.path, env=self._env, validate=self._validate)
            for check in list(self._checks):
                check(new)
        except (ConfigError, ValueError) as exc:
            logger.error(
                "config reload from %s failed; keeping the previous config:\n%s", self.path, exc
            )
            return ReloadResult(changed=False, error=str(exc))
        if new == self._current:
            logger.info("config reloaded from %s: no change", self.path)
            return ReloadResult(changed=False)
        old, self._current = self._current, new
        restart = tuple(f for f in RESTART_REQUIRED if _field(old, f) != _field(new, f))
        if restart:
            # Names only: a Redis URL may carry a password.
            logger.warning(
                "config reloaded from %s; these changed but take effect only after a restart: "
                "%s", self.path, ", ".join(restart))
        else:
            logger.info("config reloaded from %s", self.path)
        for callback in list(self._listeners):
            try:
                callback(new)
            except Exception:
                # A listener's bug must not stop the others from seeing the new config.
                logger.exception("config change listener %r failed", callback)
        return ReloadResult(changed=True, restart_required=restart)

    def install_sighup(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Reload on SIGHUP (Unix), on ``loop`` (default: the running loop)."""
        loop = loop or asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.reload_report)
        self._sighup_loop = loop

    def remove_sighup(self) -> None:
        """Undo :meth:`install_sighup`."""
        if self._sighup_loop is not None:
            self._sighup_loop.remove_signal_handler(signal.SIGHUP)
            self._sighup_loop = None

    def changed_on_disk(self) -> bool:
        """Whether the file's mtime, size or inode differ from the last load."""
        stamp = _stamp(self.path)
        return stamp is not None and stamp != self._stamp

    async def watch(self, interval_s: float = 2.0) -> None:
        """Poll the file every ``interval_s`` and reload when it changed; runs until cancelled.

        Start it as a task: ``asyncio.create_task(holder.watch(1.0))``. A file that is briefly
        missing (being replaced) is waited for, not treated as a change.
        """
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        while True:
            await asyncio.sleep(interval_s)
            if self.changed_on_disk():
                self.reload_report()
