"""Starting processes: ``callgate serve`` (the gateway, plus an in-process session worker unless
``--no-worker``) and ``callgate worker`` (a session-worker process).

This is the command-line layer, with :mod:`gateway.cli` that calls it: the only modules that
import both the gateway (``gateway/``) and the workers (``nodes/``), which otherwise meet only
through the bus (tests/test_layering.py enforces it; docs/architecture.md draws the layers).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from bus import Bus, make_bus
from config import ConfigError, ConfigHolder
from nodes import check_agents
from nodes import run_worker as run_session_worker
from vad import VadEngine

from .metrics import CONTENT_TYPE, WorkerMetrics
from .server import (
    GATEWAY_KEY,
    GatewayApp,
    TranscriberCache,
    build_app,
    follow_reloads,
    settings_from_config,
)

__all__ = ["StartupError", "listen_socket", "run_worker", "serve", "start_worker"]

log = logging.getLogger("callgate.gateway")


class StartupError(Exception):
    """``serve`` cannot start; the message is the one line it prints."""


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind the gateway's port first, before seconds of model loading: a port in use fails
    at once, with the reason (it was reported only after 7 s of loading, as a traceback)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as exc:
        # create_server appends the address to the error's text; the line names it already.
        reason = (exc.strerror or str(exc)).split(" (while attempting to bind", 1)[0]
        raise StartupError(f"cannot listen on {host}:{port}: {reason}") from exc


def _failure(task: asyncio.Task[Any]) -> str:
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    return "returned" if exc is None else f"{type(exc).__name__}: {exc}"


async def start_worker(gateway: GatewayApp, run: Callable[[asyncio.Event], Any],
                       stopping: asyncio.Event) -> asyncio.Task[None]:
    """Start an in-process worker (``run(started)``: a coroutine that sets ``started`` once
    built) and wait until it is built: one that fails raises :class:`StartupError` with the
    reason, so ``serve`` fails at start instead of reporting ready while every call gets
    silence. One that dies later (before ``stopping`` is set) is logged and fails readiness
    (``problems["worker"]``), so new calls go to another gateway."""
    started = asyncio.Event()
    worker: asyncio.Task[None] = asyncio.create_task(run(started), name="in-process-worker")
    built = asyncio.create_task(started.wait())
    await asyncio.wait({worker, built}, return_when=asyncio.FIRST_COMPLETED)
    if worker.done():
        built.cancel()
        reason = _failure(worker)
        raise StartupError(f"the in-process worker failed to start: {reason}")
    built.cancel()

    def died(task: asyncio.Task[None]) -> None:
        if stopping.is_set():
            return
        reason = f"the in-process worker stopped: {_failure(task)}"
        exc = None if task.cancelled() else task.exception()
        log.error("%s; readiness fails and new calls are refused", reason,
                  exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)
        gateway.set_problem("worker", reason)

    worker.add_done_callback(died)
    return worker


def _config(args: argparse.Namespace, command: str) -> ConfigHolder | None:
    """The config of ``callgate COMMAND``; None, said on stderr, when it is bad. A reload must
    build every agent graph too: the check is the workers' (nodes/)."""
    try:
        return ConfigHolder(args.config, validate=check_agents)
    except ConfigError as exc:
        print(f"callgate {command}: bad config:\n{exc}", file=sys.stderr)
        return None


def serve(args: argparse.Namespace) -> int:
    """``callgate serve``: the gateway, plus an in-process worker unless ``--no-worker``."""
    holder = _config(args, "serve")
    if holder is None:
        return 1
    cfg = holder.current
    try:
        settings = settings_from_config(holder)
    except ValueError as exc:
        print(f"callgate serve: {exc}", file=sys.stderr)
        return 1
    host = args.host or cfg.server.host
    port = args.port if args.port is not None else cfg.server.port
    redis_url = args.redis or cfg.bus.redis_url
    try:  # before the socket is bound: a mistake here must not leave it open
        bus = make_bus(redis_url)
    except ValueError as exc:
        print(f"callgate serve: {exc}", file=sys.stderr)
        return 1
    try:
        sock = listen_socket(host, port)
    except StartupError as exc:
        print(f"callgate serve: {exc}", file=sys.stderr)
        return 1
    if any(a.barge_in.echo_canceller == "aec3" for a in cfg.agents.values()):
        from vad import EchoCancellerUnavailable, warm_up_echo_canceller

        try:
            warm_up_echo_canceller()
        except EchoCancellerUnavailable as exc:
            sock.close()
            print(f"callgate serve: {exc}", file=sys.stderr)
            return 1
    app = build_app(settings, bus=bus, vad=VadEngine(runtime=args.vad_runtime,
                                                     max_wait_ms=args.vad_max_wait_ms))
    gateway = app[GATEWAY_KEY]
    run_worker_here = not args.no_worker

    async def background(app: web.Application) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        unfollow = follow_reloads(holder, gateway)
        holder.install_sighup(loop)
        watcher = asyncio.create_task(holder.watch(2.0))
        if settings.ops.enabled:
            log.info("console: http://%s:%d/console%s", "localhost" if host == "0.0.0.0" else host,
                     port, "?token=<ops token>" if settings.ops.token else "")
        stop = asyncio.Event()
        worker: asyncio.Task[None] | None = None
        try:
            if isinstance(settings.transcriber_for, TranscriberCache):
                await settings.transcriber_for.warm_up()
            if run_worker_here:
                worker = await start_worker(
                    gateway,
                    lambda started: run_session_worker(holder, bus, stop=stop, started=started),
                    stop)
            yield
        finally:
            stop.set()
            if worker is not None:
                await asyncio.wait({worker}, timeout=10)
                worker.cancel()
            watcher.cancel()
            await asyncio.gather(watcher, *([worker] if worker else []), return_exceptions=True)
            holder.remove_sighup()
            unfollow()
            if isinstance(settings.transcriber_for, TranscriberCache):
                settings.transcriber_for.close()

    app.cleanup_ctx.append(background)
    try:
        asyncio.run(_serve_until_drained(app, sock, lambda: holder.current.server.drain_timeout_s,
                                         "redis" if redis_url else "embedded", run_worker_here))
    except StartupError as exc:
        print(f"callgate serve: {exc}", file=sys.stderr)
        return 1
    finally:
        sock.close()
    return 0


async def _serve_until_drained(app: web.Application, sock: socket.socket,
                               drain_s: Callable[[], float], bus_kind: str,
                               worker_here: bool) -> None:
    """Serve on ``sock`` until SIGTERM/SIGINT, then drain: readiness fails and new calls get a
    polite TWiML answer while the socket stays open; calls in progress go on for up to
    ``drain_s()`` (read then: it reloads); then the app shuts down (remaining calls are
    closed) and the process exits 0."""
    gateway = app[GATEWAY_KEY]
    runner = web.AppRunner(app, handle_signals=False)
    try:
        await runner.setup()
        # Everything loaded so far (torch, the model, aiohttp, config) lives as long as the
        # process: keep it out of the collector's full passes, which otherwise walk those ~10^5
        # objects and stall every call's frames for 15-150 ms at a time (bench/load.py).
        gc.collect()
        gc.freeze()
        site = web.SockSite(runner, sock)
        await site.start()
        host, port = sock.getsockname()[:2]
        log.info("callgate gateway on http://%s:%d (bus: %s, worker: %s)", host, port, bus_kind,
                 "in-process" if worker_here else "none")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        gateway.draining = True
        timeout = drain_s()
        log.info("draining: %d call(s) in progress, up to %.0f s", len(gateway.calls), timeout)
        deadline = loop.time() + timeout
        # A webhook answered just before the drain holds a reservation whose stream is still
        # on its way: wait for it too, or its caller would reach a closed port.
        while (gateway.calls or gateway.reserved) and loop.time() < deadline:
            await gateway.calls_changed(min(1.0, max(0.0, deadline - loop.time())))
        if gateway.calls or gateway.reserved:
            log.warning("drain timeout: closing %d call(s), %d stream(s) never came",
                        len(gateway.calls), gateway.reserved)
        else:
            log.info("drained: no call in progress")
    finally:
        await runner.cleanup()  # after a failed setup too: it closes the contexts entered


WORKER_EXIT_S = 15.0
"""Once its session worker has stopped, the longest a ``callgate worker`` takes to exit (the bus
flushes and hands its calls back, asyncio cancels what is left) before it exits anyway: a call
the worker abandoned (an agent that ignores its cancellation; logged with its stack) must not
keep a stopped worker alive."""


def _exit_unless_done_in(seconds: float) -> None:
    def exit_now() -> None:
        log.error("worker: still running %.0f s after it stopped (an abandoned call that ignores "
                  "its cancellation); exiting", seconds)  # fmt: skip
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True  # a process that exits in time never waits for it
    timer.start()


def run_worker(args: argparse.Namespace) -> int:
    """``callgate worker --redis URL``: a session-worker process."""
    holder = _config(args, "worker")
    if holder is None:
        return 1

    try:
        bus = make_bus(args.redis)
    except ValueError as exc:
        print(f"callgate worker: {exc}", file=sys.stderr)
        return 1
    started = asyncio.Event()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        holder.install_sighup(loop)
        async with bus:
            runner = None
            port = getattr(args, "metrics_port", None)
            if port is not None:
                runner = await _serve_worker_metrics(bus, args.metrics_host, port)
            try:
                await run_session_worker(holder, bus, worker_id=args.worker_id, stop=stop,
                                         started=started,
                                         drain_timeout_s=getattr(args, "drain_timeout", 10.0))
            finally:
                if runner is not None:
                    await runner.cleanup()
                _exit_unless_done_in(WORKER_EXIT_S)

    try:
        asyncio.run(main())
    except (OSError, ValueError) as exc:
        if started.is_set():
            raise  # not a start-up problem: keep the traceback
        # A metrics port in use, an agent that cannot be built (an unknown voice): one line.
        print(f"callgate worker: cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve_worker_metrics(bus: Bus, host: str, port: int) -> web.AppRunner:
    """``GET /metrics`` (the bus's figures: call claims, Redis outages and reconnects, buffered
    writes) and ``GET /healthz`` for a worker process."""
    metrics = WorkerMetrics(bus.stats)

    async def render(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "bus": bus.bus_id})

    app = web.Application()
    app.add_routes([web.get("/metrics", render), web.get("/healthz", healthz)])
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("worker metrics on http://%s:%d/metrics", host, port)
    return runner
