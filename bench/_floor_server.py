"""The transport floor's server (``bench.ws_floor``): Twilio's traffic through aiohttp, no gateway.

``python -m bench._floor_server PORT [--silent]`` serves ``/twilio/media`` and does, per call,
only what any Twilio Media Streams server written on aiohttp must do: take every text frame off
the WebSocket, parse its JSON, decode a ``media`` payload's base64, and (unless ``--silent``)
answer every second inbound frame (40 ms of caller audio) with one 40 ms ``media`` message and
its ``mark``, as the gateway does while its bot talks with 40 ms playback chunks. No VAD, no
echo gate, no policy, no bus, no metrics: what this process costs per call is a floor under
any gateway of this design, callgate included.

It prints ``up`` once listening and runs until killed.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import sys

from aiohttp import WSMsgType, web

_PAYLOAD = base64.b64encode(b"\xff" * 320).decode("ascii")  # 40 ms of mu-law silence
_MEDIA = '{"event":"media","streamSid":"%s","media":{"payload":"%s"}}'
_MARK = '{"event":"mark","streamSid":"%s","mark":{"name":"c%d"}}'


def make_app(*, silent: bool) -> web.Application:
    async def media(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=1 << 20)
        await ws.prepare(request)
        stream_sid = ""
        frames = 0
        async for msg in ws:
            if msg.type is not WSMsgType.TEXT:
                continue
            obj = json.loads(msg.data)
            event = obj["event"]
            if event == "media":
                base64.b64decode(obj["media"]["payload"], validate=True)
                frames += 1
                if not silent and frames % 2 == 0:
                    await ws.send_str(_MEDIA % (stream_sid, _PAYLOAD))
                    await ws.send_str(_MARK % (stream_sid, frames))
            elif event == "start":
                stream_sid = obj["start"]["streamSid"]
            elif event == "stop":
                break
        return ws

    app = web.Application()
    app.router.add_get("/twilio/media", media)
    return app


async def _serve(port: int, silent: bool) -> None:
    runner = web.AppRunner(make_app(silent=silent), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    gc.freeze()  # as the gateway does after startup
    print("up", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    asyncio.run(_serve(int(args[0]), "--silent" in args[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
