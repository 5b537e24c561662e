"""The system under faults, from outside: ``python -m bench.chaos`` (issue 13; not in CI).

What runs, as in production, each its own process (its own session, so a signal reaches its
children too): one real ``redis-server`` (``tests.redis_server``, AOF with ``appendfsync always``
so that a restart keeps what was acknowledged), TWO gateways (``callgate serve --redis URL
--no-worker`` on two ports) and THREE ``callgate worker``s, all on the same Redis. This process
plays the callers: ``--calls`` concurrent Twilio Media Streams calls over real WebSockets (the
two gateways take turns; while one is down every new call goes to the other), each paced at 1x
looping a labelled barge-in recording, and pressing a key every ``--dtmf-every`` seconds. The
agent (``tests.faults._agents:DtmfEcho``) answers each key press with "You pressed N", so every
uplink event that a worker handled is visible, exactly once, on the call's downlink stream.

Faults, on a schedule: every ``--fault-every`` seconds a worker is frozen (SIGSTOP for
``--freeze`` s, longer than its 2 s lease, then SIGCONT) or killed (SIGKILL, then a new worker
started), in turn; Redis is killed (SIGKILL) and restarted twice; one gateway is killed (SIGKILL)
and restarted once.

Counted:

* per call, the key presses sent against the answers on its downlink (read from Redis as the
  call runs, one copy per event id: a write the bus retried is not a second answer): an answer
  missing is a lost uplink event, one too many a duplicate. An answer is its ``utterance_start``,
  whatever became of its audio: a barge-in may cut it before any of it played (a key press and
  then the caller's voice over the bot, read together after a Redis outage: the worker writes
  the answer as an utterance interrupted before its first audio, as it would have been cut live,
  ``nodes._worker._drop_stale``). Those are the worker's answers all the same (it handled the key
  press; the caller would not have heard it live either) and are counted apart, "answers cut
  before any audio"; until session 7 the worker dropped them without a trace and this bench
  counted them lost (23 in session 6);
* calls completed (the caller's ``stop`` sent, every key press answered or not) and calls cut
  (the gateway closed the socket first): those must be only the calls of the killed gateway;
* takeover time: from the freeze or kill of a worker until every call it owned has another
  owner (``cg:{CA..}:owner``), the worst over the run;
* barge-ins cleared: ``clear`` messages the callers got (``dtmf_interrupts`` is off in the
  bench's agent, so each is the caller's voice interrupting the bot).

It stops by itself after ``--minutes`` (calls still running then are let finish their key
presses, up to 30 s) and ends every process it started, on error or Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bus import EventDecodeError
from bus import protocol as bp

from ._loadgen import MEDIA, Recording, load_recording, percentile

__all__ = ["Fault", "main", "schedule"]

_REPO = Path(__file__).resolve().parents[1]
RECORDINGS = _REPO / "tests" / "recordings"
CALLER_AUDIO = ("barge_in_timit", "barge_in_mid_jfk", "barge_in_early_librivox",
                "barge_in_two_sentences_spk1")
DIGITS = "0123456789"
FRAME_S = 0.02
ACCOUNT = "AC" + "0" * 32
ANSWER = "You pressed "
STT_KEY_VAR = "CALLGATE_CHAOS_STT_KEY"
ANSWER_WAIT_S = 30.0  # at its end a call waits this long at most for its last answers


def chaos_config(stt_port: int) -> str:
    """The bench's agent: DtmfEcho; speech to text on this process's stub OpenAI endpoint (the
    gateways would otherwise decode every looped caller turn with pocketsphinx, which alone would
    fill this machine); key presses do not interrupt, so every ``clear`` is a voice barge-in."""
    return textwrap.dedent(
        f"""
        server:
          max_calls: 100000
        twilio:
          validate_signatures: false  # the callers here are the bench, not Twilio
        default_agent: dtmf
        agents:
          dtmf:
            stt:
              provider: openai
              model: whisper-1
              base_url: http://127.0.0.1:{stt_port}/v1
              api_key: ${{{STT_KEY_VAR}}}
              language: en-US
            barge_in:
              dtmf_interrupts: false
            nodes:
              - {{kind: python, name: echo, ref: "tests.faults._agents:DtmfEcho"}}
        """
    )


# -- the fault schedule ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float
    """Seconds after the calls started."""
    kind: str
    """``worker_freeze``, ``worker_kill``, ``redis_kill`` or ``gateway_kill``."""


def schedule(duration_s: float, fault_every_s: float, first_s: float) -> list[Fault]:
    """Worker faults (freeze, kill, freeze, ...) every ``fault_every_s`` from ``first_s``; Redis
    killed at 1/3 and 2/3 of the run and one gateway at 1/2, each moved half a period off any
    worker fault so that two faults never overlap. Nothing in the last ``first_s`` seconds, so
    that the last fault's calls are taken over before the run ends."""
    faults = []
    t, n = first_s, 0
    while t <= duration_s - first_s:
        faults.append(Fault(t, "worker_freeze" if n % 2 == 0 else "worker_kill"))
        t += fault_every_s
        n += 1
    worker_times = [f.at_s for f in faults]

    def apart(t: float) -> float:
        while any(abs(t - w) < fault_every_s / 4 for w in worker_times):
            t += fault_every_s / 4
        return min(t, max(first_s, duration_s - first_s))

    for frac, kind in ((1 / 3, "redis_kill"), (1 / 2, "gateway_kill"), (2 / 3, "redis_kill")):
        faults.append(Fault(apart(frac * duration_s), kind))
    return sorted(faults, key=lambda f: f.at_s)


# -- processes ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(self.argv, cwd=_REPO, env=self.env, stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL to its whole group (a frozen one is resumed first so nothing stays stopped)."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGCONT)
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


class System:
    """Redis, two gateways, three workers; every process it started is ended by ``close``."""

    def __init__(self, workdir: Path, stt_port: int) -> None:
        from tests.redis_server import RedisServer  # the one helper that runs redis-server

        self.workdir = workdir
        self.redis = RedisServer(workdir / "redis", extra_args=("--appendonly", "yes",
                                                                 "--appendfsync", "always"))
        self.config = workdir / "agents.yaml"
        self.config.write_text(chaos_config(stt_port))
        self.env = {**os.environ, "CALLGATE_VALIDATE_SIGNATURES": "false", "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": str(_REPO), STT_KEY_VAR: "chaos", "CALLGATE_REDIS_URL": ""}
        self.env.pop("CALLGATE_CONFIG", None)
        self.gateways: list[Proc] = []
        self.gateway_ports: list[int] = []
        self.workers: list[Proc] = []
        self.retired: list[Proc] = []  # killed workers, kept for their logs and the final kill
        self._incarnation: Counter[int] = Counter()

    def _callgate(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "gateway", "--log-level", "INFO", *args]

    def gateway_argv(self, port: int) -> list[str]:
        return self._callgate("serve", "--config", str(self.config), "--redis", self.redis.url,
                              "--no-worker", "--host", "127.0.0.1", "--port", str(port),
                              "--vad-runtime", "onnx")

    def worker_proc(self, slot: int) -> Proc:
        n = self._incarnation[slot]
        self._incarnation[slot] += 1
        wid = f"w{slot + 1}" + (f".{n}" if n else "")
        return Proc(wid, self._callgate("worker", "--redis", self.redis.url, "--config",
                                        str(self.config), "--worker-id", wid),
                    self.workdir / f"{wid}.log", self.env)

    def start(self) -> None:
        if not shutil.which("redis-server"):
            raise SystemExit("bench.chaos needs a redis-server binary on PATH")
        self.redis.start()
        for i in range(2):
            port = _free_port()
            gw = Proc(f"gw{i + 1}", self.gateway_argv(port), self.workdir / f"gw{i + 1}.log",
                      self.env)
            gw.start()
            self.gateways.append(gw)
            self.gateway_ports.append(port)
        for slot in range(3):
            w = self.worker_proc(slot)
            w.start()
            self.workers.append(w)

    def healthy(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.gateway_ports[i]}/healthz",
                                        timeout=1.0) as r:
                return bool(json.loads(r.read()).get("status") == "ok")
        except (OSError, ValueError):
            return False

    def check_alive(self) -> None:
        for p in [*self.gateways, *self.workers]:
            if p.popen is not None and p.popen.poll() is not None:
                raise SystemExit(f"{p.name} exited with {p.popen.returncode}:\n"
                                 + p.log.read_text(errors="replace")[-3000:])

    def close(self) -> None:
        for p in [*self.workers, *self.retired, *self.gateways]:
            p.kill()
        with contextlib.suppress(Exception):
            self.redis.stop()


# -- callers -----------------------------------------------------------------------------------
@dataclass(eq=False)
class Call:
    index: int
    sid: str
    stream_sid: str
    gateway: int
    rec: Recording
    started: float
    ends: float
    ws: aiohttp.ClientWebSocketResponse | None = None
    k: int = 0
    seq: int = 3
    sent: list[str] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)  # "You pressed N" on its downlink, in order
    answer_audio: dict[str, int] = field(default_factory=dict)  # answer utterance -> audio events
    cut_before_audio: int = 0  # answers whose utterance ended interrupted with no audio
    answer_at: list[float] = field(default_factory=list)
    eids: set[str] = field(default_factory=set)
    clears: list[float] = field(default_factory=list)  # monotonic times of each ``clear``
    outcome: str = "running"  # completed | cut | failed
    error: str | None = None
    cut_at: float | None = None
    answered: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def down_key(self) -> str:
        return f"cg:{{{self.sid}}}:down"

    def counts(self) -> tuple[int, int]:
        """(lost, duplicated) key presses."""
        sent = Counter(self.sent)
        got = Counter(a.removeprefix(ANSWER) for a in self.answers)
        lost = sum(max(0, n - got[d]) for d, n in sent.items())
        dup = sum(max(0, n - sent[d]) for d, n in got.items())
        return lost, dup

    def matched(self) -> list[int | None]:
        """For each key press, the index of its answer (answers come in order: one node
        handles a call's key presses one after another), or None."""
        out: list[int | None] = []
        j = 0
        for digit in self.sent:
            k = j
            while k < len(self.answers) and self.answers[k].removeprefix(ANSWER) != digit:
                k += 1
            if k < len(self.answers):
                out.append(k)
                j = k + 1
            else:
                out.append(None)
        return out

    def unanswered_at_hangup(self) -> int:
        """Key presses missing after the last one answered: the call hung up (after waiting
        ANSWER_WAIT_S) before they were answered. Those before it were lost mid-call."""
        n = 0
        for m in reversed(self.matched()):
            if m is not None:
                break
            n += 1
        return n


class Callers:
    def __init__(self, args: argparse.Namespace, system: System, rng: random.Random) -> None:
        self.args = args
        self.system = system
        self.rng = rng
        self.recordings = [load_recording(RECORDINGS, n) for n in CALLER_AUDIO]
        self.calls: list[Call] = []
        self.by_sid: dict[str, Call] = {}
        self.live: dict[str, Call] = {}
        self.gateway_down: set[int] = set()
        self.killed_gateway: int | None = None
        self.stopping = False
        self._n = 0

    def pick_gateway(self, index: int) -> int:
        up = [i for i in range(2) if i not in self.gateway_down]
        return index % 2 if index % 2 in up else (up[0] if up else index % 2)

    async def slot(self, http: aiohttp.ClientSession, slot: int, t_end: float) -> None:
        # Calls start staggered over the first seconds, then each slot calls again at once.
        await asyncio.sleep(self.rng.uniform(0, min(5.0, self.args.call_seconds / 4)))
        while time.monotonic() < t_end and not self.stopping:
            n = self._n
            self._n += 1
            call = Call(n, f"CA{n:032x}", f"MZ{n:032x}", self.pick_gateway(n),
                        self.recordings[n % len(self.recordings)], time.monotonic(),
                        time.monotonic() + self.args.call_seconds * self.rng.uniform(0.8, 1.2))
            self.calls.append(call)
            self.by_sid[call.sid] = call
            await self.run_call(http, call)

    async def run_call(self, http: aiohttp.ClientSession, call: Call) -> None:
        from gateway import twilio_protocol as tp

        url = f"ws://127.0.0.1:{self.system.gateway_ports[call.gateway]}/twilio/media"
        try:
            call.ws = await http.ws_connect(url, autoping=True, max_msg_size=1 << 22)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            call.outcome, call.error = "failed", f"connect: {type(exc).__name__}: {exc}"
            await asyncio.sleep(1.0)
            return
        ws = call.ws
        self.live[call.sid] = call
        reader = asyncio.create_task(self._read(call))
        try:
            await ws.send_str(tp.build_connected())
            await ws.send_str(tp.build_start(
                sequence_number=1, stream_sid=call.stream_sid, account_sid=ACCOUNT,
                call_sid=call.sid, tracks=["inbound"], custom_parameters={"bench": "chaos"}))
            t0 = time.monotonic()
            next_key = t0 + self.args.dtmf_every
            while time.monotonic() < call.ends and not reader.done():
                now = time.monotonic()
                # Media frame k leaves once its 20 ms are complete; a late loop catches up.
                while t0 + (call.k + 1) * FRAME_S <= now:
                    payload = call.rec.payloads[call.k % len(call.rec.payloads)]
                    await ws.send_str(MEDIA % (call.seq, call.k + 1, call.k * 20, payload,
                                               call.stream_sid))
                    call.seq += 1
                    call.k += 1
                if now >= next_key:
                    digit = DIGITS[len(call.sent) % len(DIGITS)]
                    await ws.send_str(tp.build_dtmf(sequence_number=call.seq,
                                                    stream_sid=call.stream_sid, digit=digit))
                    call.seq += 1
                    call.sent.append(digit)
                    call.sent_at.append(now)
                    next_key += self.args.dtmf_every
                await asyncio.sleep(max(0.0, t0 + (call.k + 1) * FRAME_S - time.monotonic()))
            if reader.done():
                raise ConnectionError("the gateway closed the call")
            # Let the last key presses be answered before hanging up (frames go on meanwhile
            # would only make more barge-ins; the line is simply quiet).
            deadline = time.monotonic() + ANSWER_WAIT_S
            while len(call.answers) < len(call.sent) and time.monotonic() < deadline \
                    and not reader.done():
                call.answered.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(call.answered.wait(), 1.0)
            if reader.done():
                raise ConnectionError("the gateway closed the call")
            await ws.send_str(tp.build_stop(sequence_number=call.seq, stream_sid=call.stream_sid,
                                            account_sid=ACCOUNT, call_sid=call.sid))
            call.outcome = "completed"
            await ws.close()
        except (ConnectionError, aiohttp.ClientError, OSError) as exc:
            call.outcome, call.error = "cut", f"{type(exc).__name__}: {exc}"
            call.cut_at = time.monotonic()
        finally:
            if not ws.closed:
                await ws.close()
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            # The tap goes on reading this call's downlink until its last answer is in.
            asyncio.get_running_loop().call_later(3.0, self.live.pop, call.sid, None)

    async def _read(self, call: Call) -> None:
        ws = call.ws
        assert ws is not None
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.TEXT and '"clear"' in msg.data:
                with contextlib.suppress(ValueError):
                    if json.loads(msg.data).get("event") == "clear":
                        call.clears.append(time.monotonic())

    async def tap(self) -> None:
        """Every answer on the live calls' downlinks, one per event id (as the gateway dedups)."""
        from redis.asyncio import Redis
        from redis.exceptions import RedisError
        from redis.typing import KeyT, StreamIdT

        raw = Redis.from_url(self.system.redis.url, socket_timeout=5)
        last: dict[str, bytes] = {}
        try:
            while not (self.stopping and not self.live):
                keys: dict[KeyT, StreamIdT] = {
                    c.down_key: last.get(c.sid, b"0-0") for c in list(self.live.values())
                }
                if not keys:
                    await asyncio.sleep(0.1)
                    continue
                try:
                    got = await raw.xread(keys, count=500, block=200)
                except (RedisError, OSError):
                    await asyncio.sleep(0.2)  # Redis down: the faults do that; read on after
                    continue
                assert isinstance(got, list)  # RESP2 (the client's default): [[key, entries]]
                now = time.monotonic()
                for key, entries in got:
                    sid = key.decode().split("{")[1].split("}")[0]
                    call = self.by_sid.get(sid)
                    for mid, fields in entries:
                        last[sid] = mid
                        if call is None or b"e" not in fields:
                            continue
                        wire = json.loads(fields[b"e"])
                        try:
                            event = bp.decode(wire)
                        except EventDecodeError:
                            continue  # the gateway skips it too
                        eid = wire.get("eid")  # the bus's envelope: a re-sent copy has the same
                        if isinstance(event, bp.Audio | bp.UtteranceEnd):
                            audio = call.answer_audio.get(event.utterance_id)
                            if audio is None or eid in call.eids:
                                continue  # not an answer, or a copy
                            call.eids.add(eid)
                            if isinstance(event, bp.Audio):
                                call.answer_audio[event.utterance_id] = audio + 1
                            elif event.interrupted and not audio:
                                call.cut_before_audio += 1
                            continue
                        if not isinstance(event, bp.UtteranceStart):
                            continue
                        text = event.text or ""
                        if not text.startswith(ANSWER) or eid in call.eids:
                            continue
                        call.eids.add(eid)
                        call.answer_audio[event.utterance_id] = 0
                        call.answers.append(text)
                        call.answer_at.append(now)
                        call.answered.set()
        finally:
            await raw.aclose()


# -- faults ------------------------------------------------------------------------------------
class Chaos:
    def __init__(self, args: argparse.Namespace, system: System, callers: Callers,
                 rng: random.Random) -> None:
        self.args = args
        self.system = system
        self.callers = callers
        self.rng = rng
        self.log: list[dict[str, Any]] = []
        self.takeovers: list[float] = []
        self.redis_down: list[tuple[float, float]] = []
        self.gateway_cut_window: tuple[float, float] | None = None

    def note(self, t0: float, what: str, **kw: Any) -> None:
        entry = {"t_s": round(time.monotonic() - t0, 1), "fault": what, **kw}
        self.log.append(entry)
        print(f"  [{entry['t_s']:7.1f}s] {what} {' '.join(f'{k}={v}' for k, v in kw.items())}",
              flush=True)

    async def owners(self, sids: list[str]) -> dict[str, bytes | str | None]:
        from redis.asyncio import Redis

        raw = Redis.from_url(self.system.redis.url, socket_timeout=2)
        try:
            values = await raw.mget([f"cg:{{{s}}}:owner" for s in sids]) if sids else []
            return dict(zip(sids, values, strict=True))
        finally:
            await raw.aclose()

    async def takeover(self, victim: str, t_fault: float, limit_s: float) -> float | None:
        """Seconds until no live call is owned by ``victim`` any more (None: none was)."""
        owned = [s for s, o in (await self.owners(list(self.callers.live))).items()
                 if o == victim.encode()]
        if not owned:
            return None
        while time.monotonic() - t_fault < limit_s:
            live = [s for s in owned if s in self.callers.live]
            now = await self.owners(live)
            if all(o is not None and o != victim.encode() for o in now.values()):
                return time.monotonic() - t_fault
            await asyncio.sleep(0.05)
        return float("inf")

    async def run(self, faults: list[Fault], t0: float) -> None:
        s = self.system
        for fault in faults:
            await asyncio.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
            if fault.kind in ("worker_freeze", "worker_kill"):
                # A worker that owns calls (any, when none does), so there is a takeover to time.
                owned_by = [await self._owned_by(w.name) for w in s.workers]
                busy = [i for i, n in enumerate(owned_by) if n] or list(range(len(s.workers)))
                slot = self.rng.choice(busy)
                w, owned = s.workers[slot], owned_by[slot]
                if fault.kind == "worker_freeze":
                    w.signal_group(signal.SIGSTOP)
                    t = time.monotonic()
                    self.note(t0, "worker frozen", worker=w.name, calls=owned)
                    took = await self.takeover(w.name, t, self.args.freeze)
                    await asyncio.sleep(max(0.0, t + self.args.freeze - time.monotonic()))
                    w.signal_group(signal.SIGCONT)
                    self.note(t0, "worker resumed", worker=w.name,
                              takeover_s=None if took is None else round(took, 2))
                else:
                    w.kill()
                    t = time.monotonic()
                    s.retired.append(w)
                    self.note(t0, "worker killed", worker=w.name, calls=owned)
                    new = s.worker_proc(slot)
                    new.start()
                    s.workers[slot] = new
                    took = await self.takeover(w.name, t, 30.0)
                    self.note(t0, "worker restarted", worker=new.name,
                              takeover_s=None if took is None else round(took, 2))
                if took is not None:
                    self.takeovers.append(took)
            elif fault.kind == "redis_kill":
                s.redis.kill()
                t = time.monotonic()
                self.note(t0, "redis killed")
                await asyncio.sleep(self.args.redis_down)
                await asyncio.to_thread(s.redis.restart)
                self.redis_down.append((t, time.monotonic()))
                self.note(t0, "redis restarted", down_s=round(time.monotonic() - t, 1))
            elif fault.kind == "gateway_kill":
                i = self.rng.randrange(2)
                gw = s.gateways[i]
                self.callers.gateway_down.add(i)
                self.callers.killed_gateway = i
                on_it = sum(1 for c in self.callers.live.values()
                            if c.gateway == i and c.outcome == "running")
                gw.kill()
                t = time.monotonic()
                self.note(t0, "gateway killed", gateway=gw.name, calls=on_it)
                await asyncio.sleep(self.args.gateway_down)
                gw.start()
                while not await asyncio.to_thread(s.healthy, i):
                    if not gw.alive():
                        raise SystemExit(f"{gw.name} did not restart:\n"
                                         + gw.log.read_text(errors="replace")[-3000:])
                    await asyncio.sleep(0.2)
                self.gateway_cut_window = (t - 0.5, t + 10.0)
                self.callers.gateway_down.discard(i)
                self.note(t0, "gateway restarted", gateway=gw.name,
                          down_s=round(time.monotonic() - t, 1))

    async def _owned_by(self, worker: str) -> int:
        return sum(1 for o in (await self.owners(list(self.callers.live))).values()
                   if o == worker.encode())


# -- the run -----------------------------------------------------------------------------------
async def _stt_stub(port: int) -> Any:
    from aiohttp import web

    async def transcribe(request: web.Request) -> web.Response:
        try:
            await request.read()
        except ConnectionResetError:  # the gateway gave the upload up (a barge-in, a kill)
            return web.Response(status=499)
        return web.json_response({"text": "hello"})

    app = web.Application(client_max_size=1 << 24)
    app.router.add_post("/v1/audio/transcriptions", transcribe)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _wait_up(system: System, timeout: float) -> None:
    from redis.asyncio import Redis

    raw = Redis.from_url(system.redis.url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            system.check_alive()
            gws = all([await asyncio.to_thread(system.healthy, i) for i in range(2)])
            ws = all([await raw.exists(f"cg:worker:{w.name}") for w in system.workers])
            if gws and ws:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"the system did not come up in {timeout:.0f} s")
            await asyncio.sleep(0.3)
    finally:
        await raw.aclose()


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    stt_port = _free_port()
    stub = await _stt_stub(stt_port)
    system = System(workdir, stt_port)
    try:
        system.start()
        print(f"starting redis, 2 gateways, 3 workers (logs in {workdir}) ...", flush=True)
        await _wait_up(system, 180)
        duration = args.seconds if args.seconds is not None else args.minutes * 60
        faults = schedule(duration, args.fault_every, args.first_fault)
        print(f"{args.calls} calls for {duration:.0f} s, {len(faults)} faults", flush=True)
        callers = Callers(args, system, rng)
        chaos = Chaos(args, system, callers, rng)
        t0 = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=None, connect=10)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=timeout) as http:
            tap = asyncio.create_task(callers.tap())
            slots = [asyncio.create_task(callers.slot(http, i, t0 + duration))
                     for i in range(args.calls)]
            faults_task = asyncio.create_task(chaos.run(faults, t0))
            await asyncio.gather(*slots)
            callers.stopping = True
            await faults_task
            await asyncio.wait_for(tap, 30)
        wall = time.monotonic() - t0
        system.check_alive()
        return report(args, callers, chaos, faults, wall)
    finally:
        system.close()
        await stub.cleanup()


def report(args: argparse.Namespace, callers: Callers, chaos: Chaos, faults: list[Fault],
           wall: float) -> dict[str, Any]:
    calls = callers.calls
    window = chaos.gateway_cut_window
    completed = [c for c in calls if c.outcome == "completed"]
    cut = [c for c in calls if c.outcome == "cut"]
    cut_ok = [c for c in cut if c.gateway == callers.killed_gateway and window is not None
              and c.cut_at is not None and window[0] <= c.cut_at <= window[1]]
    cut_other = [c for c in cut if c not in cut_ok]
    failed = [c for c in calls if c.outcome == "failed"]
    lost = sum(c.counts()[0] for c in completed)
    at_hangup = sum(min(c.counts()[0], c.unanswered_at_hangup()) for c in completed)
    dup = sum(c.counts()[1] for c in completed)
    keys = sum(len(c.sent) for c in completed)
    cut_dup = sum(c.counts()[1] for c in cut)
    # Key press to its answer on the downlink, every answered key press of a completed call.
    delays = sorted(c.answer_at[m] - s for c in completed
                    for s, m in zip(c.sent_at, c.matched(), strict=True) if m is not None)
    bad = [c for c in calls if c in cut_other or c in failed
           or (c.outcome == "completed" and c.counts() != (0, 0))]
    out = {
        "calls": args.calls, "seconds": round(wall, 1), "seed": args.seed,
        "faults": chaos.log,
        "calls_started": len(calls), "calls_completed": len(completed),
        "calls_cut": len(cut), "calls_cut_on_killed_gateway": len(cut_ok),
        "calls_cut_elsewhere": len(cut_other), "calls_failed_to_connect": len(failed),
        "key_presses": keys, "events_lost": lost, "events_lost_mid_call": lost - at_hangup,
        "unanswered_at_hangup": at_hangup, "events_duplicated": dup,
        "answers_cut_before_audio": sum(c.cut_before_audio for c in completed),
        "duplicated_on_cut_calls": cut_dup,
        "worst_takeover_s": round(max(chaos.takeovers), 2) if chaos.takeovers else None,
        "takeovers_s": [round(t, 2) for t in chaos.takeovers],
        "answer_delay_p50_s": percentile(delays, 0.5),
        "answer_delay_max_s": delays[-1] if delays else None,
        "barge_ins_cleared": sum(len(c.clears) for c in calls),
        "barge_ins_cleared_during_redis_outage": sum(
            1 for c in calls for t in c.clears if any(a <= t <= b for a, b in chaos.redis_down)),
        "problems": [
            {"call": c.sid, "gateway": c.gateway, "outcome": c.outcome, "error": c.error,
             "sent": "".join(c.sent), "answered": "".join(a.removeprefix(ANSWER) for a in c.answers)}
            for c in bad
        ],
    }
    return out


def print_table(r: dict[str, Any]) -> None:
    rows = [
        ("calls started", r["calls_started"]),
        ("calls completed", r["calls_completed"]),
        ("calls cut (all)", r["calls_cut"]),
        ("  of which on the killed gateway", r["calls_cut_on_killed_gateway"]),
        ("  of which elsewhere (must be 0)", r["calls_cut_elsewhere"]),
        ("calls that failed to connect", r["calls_failed_to_connect"]),
        ("key presses (completed calls)", r["key_presses"]),
        ("uplink events lost", r["events_lost"]),
        ("  of which mid-call (a later key answered)", r["events_lost_mid_call"]),
        ("  of which unanswered at hang-up", r["unanswered_at_hangup"]),
        ("uplink events duplicated", r["events_duplicated"]),
        ("answers cut by a barge-in before any audio", r["answers_cut_before_audio"]),
        ("worst takeover (s)", r["worst_takeover_s"]),
        ("answer delay p50 / max (s)", f"{_f(r['answer_delay_p50_s'])} / {_f(r['answer_delay_max_s'])}"),
        ("barge-ins cleared", r["barge_ins_cleared"]),
        ("  of which while Redis was down", r["barge_ins_cleared_during_redis_outage"]),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"\nchaos: {r['calls']} concurrent calls, {r['seconds']} s, seed {r['seed']}, "
          f"{len(r['faults'])} fault steps")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    for p in r["problems"][:20]:
        print(f"  problem: {p}")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=40, help="concurrent calls (default 40)")
    p.add_argument("--minutes", type=float, default=20.0, help="run length (default 20)")
    p.add_argument("--seconds", type=float, default=None,
                   help="run length in seconds (overrides --minutes)")
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--out", type=Path, default=None, help="write every figure here (JSON)")
    p.add_argument("--call-seconds", type=float, default=60.0, help="mean call length (default 60)")
    p.add_argument("--dtmf-every", type=float, default=2.0, help="a key press every S (default 2)")
    p.add_argument("--fault-every", type=float, default=90.0, help="worker fault period (default 90)")
    p.add_argument("--first-fault", type=float, default=30.0, help="first fault after S (default 30)")
    p.add_argument("--freeze", type=float, default=6.0, help="SIGSTOP length (default 6; lease 2)")
    p.add_argument("--redis-down", type=float, default=5.0, help="Redis down for S (default 5)")
    p.add_argument("--gateway-down", type=float, default=5.0, help="gateway down for S (default 5)")
    p.add_argument("--workdir", type=Path, default=None, help="keep the logs here")
    args = p.parse_args(argv)
    if args.calls < 1 or (args.seconds if args.seconds is not None else args.minutes * 60) <= 0:
        p.error("--calls and the run length must be positive")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="callgate-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        result = asyncio.run(run(args, workdir))
    except KeyboardInterrupt:
        print("chaos: interrupted; every process it started is ended", file=sys.stderr)
        return 130
    print_table(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    bad = result["events_lost"] or result["events_duplicated"] or result["calls_cut_elsewhere"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
