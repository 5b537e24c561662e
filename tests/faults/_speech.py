"""A text-to-speech server speaking OpenAI's ``/v1/audio/speech`` on loopback whose answers a
test holds and releases (the worker's output backs up while it holds them), and the agent config the
fault tests give it: one key-press echo agent speaking through it."""

from __future__ import annotations

import asyncio
import textwrap

import numpy as np
from aiohttp import web

__all__ = ["HeldSpeech", "dtmf_echo_config"]


class HeldSpeech:
    """``POST /v1/audio/speech``: records each request's text, answers (100 ms of 24 kHz PCM)
    only while ``released`` is set (clear it again to hold the answers after it)."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.released = asyncio.Event()
        self.base_url = ""
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> HeldSpeech:
        app = web.Application()
        app.router.add_post("/v1/audio/speech", self._speech)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.released.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.asked.append(str(body.get("input", "")))
        await self.released.wait()
        pcm = (np.sin(np.arange(2400) / 24000 * 2 * np.pi * 300) * 8000).astype("<i2").tobytes()
        resp = web.Response(body=pcm, headers={"Content-Type": "audio/pcm"})
        resp.force_close()
        return resp



def dtmf_echo_config(base_url: str, *, dtmf_interrupts: bool = True) -> str:
    """agents.yaml for one agent answering each key press (``tests.faults._agents:DtmfEcho``),
    its text to speech at ``base_url``."""
    barge_in = "" if dtmf_interrupts else """
            barge_in:
              dtmf_interrupts: false"""
    return textwrap.dedent(
        f"""
        default_agent: dtmf
        agents:
          dtmf:
            tts: {{provider: openai, model: tts-1, voice: alloy, base_url: "{base_url}",
                   api_key: "${{CG_TEST_TTS_KEY}}"}}{barge_in}
            nodes:
              - {{kind: python, name: echo, ref: "tests.faults._agents:DtmfEcho"}}
        """
    )
