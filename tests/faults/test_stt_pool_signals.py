"""The speech-to-text pool's processes under signals, from outside: a SIGHUP to the process group
(the terminal closing) leaves them running, a dead one is replaced on the next turn, and a
gateway killed with SIGKILL takes them with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.audio import read_wav_ulaw, ulaw_to_pcm16
from speech import PocketsphinxPoolTranscriber
from tests import recordings_index as rec

REPO = Path(__file__).resolve().parents[2]
NAME = "barge_in_command_goforward"


def _turn(name: str = NAME) -> bytes:
    labels = json.loads((rec.RECORDINGS / f"{name}.json").read_text())
    speech = next(e for e in labels["events"] if e["kind"] == "speech")
    ulaw = read_wav_ulaw(rec.RECORDINGS / f"{name}.wav")
    return ulaw_to_pcm16(ulaw[int((speech["start_ms"] - 300) * 8): int((speech["end_ms"] + 300) * 8)])


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


async def _decode(t: PocketsphinxPoolTranscriber) -> str:
    stream = t.open_stream()
    pcm = _turn()
    for i in range(0, len(pcm), 320):
        stream.feed(pcm[i : i + 320])
    return (await stream.finish()).text


# A stand-in gateway: owns a pool, reloads on SIGHUP as `callgate serve` does, decodes on request.
GATEWAY = textwrap.dedent(
    """
    import asyncio, json, signal, sys
    from speech import PocketsphinxPoolTranscriber
    from tests.faults.test_stt_pool_signals import _decode

    async def main():
        hups = []
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, lambda: hups.append(1))
        t = PocketsphinxPoolTranscriber(workers=2)
        await t.warm_up()
        print(json.dumps({"pids": t.worker_pids()}), flush=True)
        reader = asyncio.StreamReader()
        await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while await reader.readline():
            text = await _decode(t)
            print(json.dumps({"text": text, "pids": t.worker_pids(), "rebuilds": t.rebuilds,
                              "hups": len(hups)}), flush=True)
        t.close()

    asyncio.run(main())
    """
)


def _start_gateway() -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", GATEWAY], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the gateway stand-in exited with {proc.wait()}"
    pids = json.loads(line)["pids"]
    assert len(pids) == 2
    return proc, pids


def _ask(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"the gateway stand-in exited with {proc.wait()}"
    reply: dict[str, object] = json.loads(line)
    return reply


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def test_sighup_to_the_process_group_spares_the_pool() -> None:
    proc, pids = _start_gateway()
    try:
        os.killpg(proc.pid, signal.SIGHUP)  # what closing the terminal does
        reply = _ask(proc)  # the gateway's handler has run by the time it answers
        assert reply["hups"] == 1
        assert "go forward ten" in str(reply["text"])
        assert reply["pids"] == pids and reply["rebuilds"] == 0
        assert all(_alive(pid) for pid in pids)
    finally:
        _stop(proc)


def test_gateway_killed_takes_its_stt_processes_with_it() -> None:
    proc, pids = _start_gateway()
    assert all(_alive(pid) for pid in pids)
    _stop(proc)  # SIGKILL
    _wait_for(lambda: not any(_alive(pid) for pid in pids), 10.0, f"STT processes {pids} to exit")


async def test_a_broken_pool_is_rebuilt_for_the_next_turn() -> None:
    t = PocketsphinxPoolTranscriber(workers=1)
    try:
        await t.warm_up()
        (pid,) = t.worker_pids()
        os.kill(pid, signal.SIGKILL)  # the pool is broken from here on
        _wait_for(lambda: not _alive(pid), 10.0, "the worker to die")
        assert "go forward ten" in await _decode(t)
        assert t.rebuilds == 1
        assert t.worker_pids() and pid not in t.worker_pids()
        assert "go forward ten" in await _decode(t)  # and the new pool stays usable
        assert t.rebuilds == 1
    finally:
        t.close()
