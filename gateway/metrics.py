"""Prometheus metrics of one gateway process, served at ``GET /metrics``.

Each :class:`GatewayMetrics` has its own registry (tests build many gateways in one process).
Call events reach it through the call's timeline (``observe_event``), so the barge-in path itself
carries no metrics code; engine and bus figures are read when Prometheus scrapes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from .timeline import TURN_STAGES

__all__ = ["BUS_COUNTERS", "CONTENT_TYPE", "REFUSAL_REASONS", "GatewayMetrics", "WorkerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.5, 0.75, 1.0, 2.0)
# Per-turn stages span the end-of-turn wait (0.2-2.4 s) and slow providers; the targets of
# voice to voice (0.7 s p50, 1.1 s p95) are bounds.
_TURN_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5,
                 2.0, 2.5, 3.0, 5.0)

REFUSAL_REASONS = ("draining", "at_capacity", "overloaded", "socket_over_capacity", "token",
                   "unhealthy", "duplicate_stream", "pending_sockets", "start_timeout",
                   "signature", "stream_key")
"""The ``reason`` label of ``callgate_calls_refused_total`` (deploy/prometheus/alerts.yaml
names them; every series exists from start-up, at 0, so the first refusal is an increase).
``unhealthy``: a part the gateway needs is down (the in-process worker); ``duplicate_stream``:
a second stream for a call with a live one; ``pending_sockets``: too many sockets without a
``start``; ``start_timeout``: a socket closed for sending no valid ``start`` in time;
``signature``: a webhook or upgrade without a valid ``X-Twilio-Signature``; ``stream_key``: an
upgrade whose URL's token is forged, expired or spent (a replayed upgrade)."""

BUS_COUNTERS = {
    "outages": "Times the bus lost its server (Redis)",
    "reconnects": "Times the bus got its server back after an outage",
    "calls_claimed": "Calls this process's workers claimed from the bus",
    "orphans_claimed": "Calls taken over from a worker that stopped renewing its lease",
    "calls_lost": "Calls this process's workers lost to another worker (fenced out after a stall)",
    "calls_ended_gateway_lost": "Calls ended because their gateway stopped renewing its liveness key",
    "writes_dropped": "Bus writes dropped because an outage outlasted the write buffer",
}


def _bus_families(stats: dict[str, float]) -> Iterable[Any]:
    for name, value in stats.items():
        if name in BUS_COUNTERS:
            yield CounterMetricFamily(f"callgate_bus_{name}", BUS_COUNTERS[name], value=value)
        else:
            yield GaugeMetricFamily(f"callgate_bus_{name}", f"Bus figure {name}", value=value)


class _BusCollector(Collector):
    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Any]:
        yield from _bus_families(self._read())


class FrameCounter(Collector):
    """A counter bumped for every Twilio frame: a plain int, no lock.

    prometheus_client's ``Counter.inc`` and ``Histogram.observe`` take a lock and walk their
    buckets in Python; at hundreds of frames per call-second that was ~2 % of the gateway's CPU
    (bench/load.py). The gateway touches these only from its event loop's thread, so a plain
    int and a bisect are enough; Prometheus reads them through ``collect`` like any metric."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name, self._doc = name, documentation
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount

    def collect(self) -> Iterable[Any]:
        yield CounterMetricFamily(self._name, self._doc, value=self.value)


class FrameHistogram(Collector):
    """A histogram observed for every Twilio frame (see :class:`FrameCounter`)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self._name, self._doc = name, documentation
        self._bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self._bounds) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def collect(self) -> Iterable[Any]:
        cumulative, total = [], 0
        for bound, count in zip((*self._bounds, float("inf")), self._counts, strict=True):
            total += count
            cumulative.append((_le(bound), total))
        yield HistogramMetricFamily(self._name, self._doc, buckets=cumulative,
                                    sum_value=self._sum)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class _Callbacks(Collector):
    """Figures read at scrape time from the objects that own them."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Any]:
        s = self._read()
        yield GaugeMetricFamily("callgate_active_calls", "Calls in progress", value=s["calls"])
        yield GaugeMetricFamily("callgate_draining", "1 while the gateway drains",
                                value=1 if s["draining"] else 0)
        yield GaugeMetricFamily("callgate_overloaded",
                                "1 while new calls are refused because the gateway runs late "
                                "(frame processing or event loop, gateway.overload)",
                                value=1 if s["overloaded"] else 0)
        yield GaugeMetricFamily("callgate_calls_reserved",
                                "Webhooks answered whose stream has not started yet",
                                value=s.get("reserved", 0))
        yield GaugeMetricFamily("callgate_sockets_pending",
                                "Media sockets open without a valid start yet",
                                value=s.get("sockets_pending", 0))
        yield CounterMetricFamily("callgate_vad_batches", "Batched VAD inferences run",
                                  value=s["vad_batches"])
        yield CounterMetricFamily("callgate_vad_windows", "VAD windows scored (all calls)",
                                  value=s["vad_windows"])
        yield GaugeMetricFamily("callgate_vad_mean_batch_size", "VAD windows per inference",
                                value=s["vad_windows"] / s["vad_batches"] if s["vad_batches"] else 0)
        yield from _bus_families(s.get("bus", {}))


class GatewayMetrics:
    def __init__(self, read_state: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.frames = FrameCounter("callgate_frames", "Inbound media frames processed")
        r.register(self.frames)
        self.frames_skipped = Counter("callgate_frames_skipped",
                                      "Malformed or out-of-place Twilio frames skipped", registry=r)
        self.calls = Counter("callgate_calls", "Calls started", registry=r)
        self.calls_refused = Counter("callgate_calls_refused",
                                     "Calls refused (capacity, draining, overload, bad token)",
                                     ["reason"], registry=r)
        for reason in REFUSAL_REASONS:
            self.calls_refused.labels(reason=reason)
        self.barge_ins = Counter("callgate_barge_ins", "Interrupts committed to the agent",
                                 ["reason"], registry=r)
        self.clears = Counter("callgate_clears", "clear messages sent to Twilio", registry=r)
        self.suppressed = Counter("callgate_interrupts_suppressed",
                                  "Caller speech over a non-interruptible utterance", registry=r)
        self.resumes = Counter("callgate_false_interruption_resumes",
                               "Pauses that turned out to be backchannels or noise and resumed",
                               registry=r)
        self.stale_replies_dropped = Counter(
            "callgate_stale_replies_dropped",
            "Replies dropped unheard as the answer to a turn whose reply was cancelled (made "
            "before the worker read the interrupt; reason: resumed, revised)",
            ["reason"], registry=r)
        self.onset_to_clear = Histogram("callgate_onset_to_clear_seconds",
                                        "Caller speech onset to clear sent (media time)",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.turn_latency = Histogram(
            "callgate_turn_latency_seconds",
            "Per caller turn, from the end of the caller's speech to each stage of the reply "
            "(media time; stage: " + ", ".join(TURN_STAGES) + "; first_audio is voice to voice)",
            ["stage"], buckets=_TURN_BUCKETS, registry=r)
        self.turn_stt = Histogram("callgate_turn_stt_seconds",
                                  "Final transcript after it was asked for (commit or upload)",
                                  buckets=_TURN_BUCKETS, registry=r)
        self.turn_hold = Histogram(
            "callgate_turn_hold_seconds",
            "The reply's first audio on the line after its audio came and the turn's end was "
            "decided (the gateway's own share)", buckets=_LATENCY_BUCKETS, registry=r)
        self.stt_errors = Counter("callgate_stt_errors", "Speech-to-text failures",
                                  ["fallback"], registry=r)
        self.publish_seconds = Histogram("callgate_bus_publish_seconds",
                                         "Time to hand an uplink event to the bus",
                                         buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1),
                                         registry=r)
        lag_buckets = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                       0.1, 0.25, 1.0)
        self.frame_receive_to_done = FrameHistogram(
            "callgate_frame_processing_seconds",
            "Inbound frame handed to the call to fully processed (VAD batch, decision, sends)",
            lag_buckets,
        )
        self.frame_lag = FrameHistogram(
            "callgate_frame_lag_seconds",
            "How far behind its media time a frame is done, against the call's best frame",
            lag_buckets,
        )
        self.loop_lag = FrameHistogram(
            "callgate_event_loop_lag_seconds",
            "How late the event loop ran a 50 ms timer (gateway.overload's probe)",
            lag_buckets,
        )
        r.register(self.frame_receive_to_done)
        r.register(self.frame_lag)
        r.register(self.loop_lag)
        self.active = Gauge("callgate_calls_streaming", "Calls with audio flowing", registry=r)
        r.register(_Callbacks(read_state))

    def refused(self, reason: str) -> None:
        """A call or media stream turned away (``reason``: one of :data:`REFUSAL_REASONS`)."""
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        self.calls_refused.labels(reason=reason).inc()

    def observe_event(self, event: dict[str, Any]) -> None:
        """A call's timeline listener."""
        kind = event["type"]
        if kind == "barge_in":
            self.barge_ins.labels(reason=str(event.get("reason", "speech"))).inc()
        elif kind == "clear_sent":
            self.clears.inc()
            onset = event.get("onset_ms")
            if onset is not None:
                self.onset_to_clear.observe(max(0.0, (float(event["t_ms"]) - onset) / 1000))
        elif kind == "interrupt_suppressed":
            self.suppressed.inc()
        elif kind == "bot_utterance_interrupted" and event.get("dropped") == "cancelled_turn":
            self.stale_replies_dropped.labels(reason=str(event.get("reason"))).inc()
        elif kind == "bot_utterance_resumed":
            self.resumes.inc()
        elif kind == "call_started":
            self.calls.inc()
        elif kind == "turn_latency":
            for stage in TURN_STAGES:
                ms = event.get(f"{stage}_ms")
                if ms is not None:
                    self.turn_latency.labels(stage=stage).observe(max(0.0, ms / 1000))
            self.turn_stt.observe(max(0.0, event["stt_ms"] / 1000))
            self.turn_hold.observe(event["hold_ms"] / 1000)
        elif kind == "stt_error":
            self.stt_errors.labels(fallback=str(event.get("fallback") or "none")).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class WorkerMetrics:
    """A session-worker process's metrics (``callgate worker --metrics-port``): its bus's
    figures, call claims and Redis reconnects among them."""

    def __init__(self, read_bus: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_BusCollector(read_bus))

    def render(self) -> bytes:
        return generate_latest(self.registry)
