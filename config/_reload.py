"""Hot reload: hold the current config and swap it when the file changes, never for a bad one.

A reload loads the whole file again. If the new file is bad the old config stays in force and the
problems are logged (logger ``callgate.config``), so a typo made while editing a live system costs
nothing. Python modules named by ``ref`` are imported once per process: a reload picks up a new
``ref``, not new code in an already imported module.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path

from ._errors import ConfigError
from ._loader import Validator, load_config, resolve_config_path
from ._schema import Config

__all__ = ["ConfigHolder"]

logger = logging.getLogger("callgate.config")

Listener = Callable[[Config], None]


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

    def reload(self) -> bool:
        """Load the file again; returns whether the config in force changed.

        A bad file is logged (with every problem, each naming its line) and the old config kept.
        An unchanged file returns False and notifies nobody.
        """
        self._stamp = _stamp(self.path)
        try:
            new = load_config(self.path, env=self._env, validate=self._validate)
        except ConfigError as exc:
            logger.error(
                "config reload from %s failed; keeping the previous config:\n%s", self.path, exc
            )
            return False
        if new == self._current:
            logger.info("config reloaded from %s: no change", self.path)
            return False
        self._current = new
        logger.info("config reloaded from %s", self.path)
        for callback in list(self._listeners):
            try:
                callback(new)
            except Exception:
                # A listener's bug must not stop the others from seeing the new config.
                logger.exception("config change listener %r failed", callback)
        return True

    def install_sighup(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Reload on SIGHUP (Unix), on ``loop`` (default: the running loop)."""
        loop = loop or asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.reload)
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
                self.reload()
