"""The console in a real headless browser: Debian's chromium driven by selenium through
chromium-driver, its microphone a fake device playing a dev recording.

The page places a call to the shipped agent; the greeting plays in the page (marks echoed as
the page plays it); the caller's recorded "go forward ten meters" barges in: the gateway
clears the greeting, the timeline shows the pause and its latency; the transcript appears; the
page hangs up and the call ends cleanly. A screenshot is saved and checked not to be blank.
The call was recorded by the gateway, and its folder replays to the same decisions.
"""

from __future__ import annotations

import asyncio
import os
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from audio import read_wav_ulaw, ulaw_to_float32
from gateway.recorder import replay_folder
from tests import recordings_index as rec
from tests.console.conftest import Served
from tests.console.test_recorder import decisions, read_events, recorded_folder

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
RECORDING = "barge_in_command_goforward"
SCREENSHOT_ENV = "CALLGATE_CONSOLE_SCREENSHOT"
"""Also save the screenshot there (how docs/console.png, which the README shows, is made)."""



def _need_browser() -> None:
    """CI sets CALLGATE_REQUIRE_BROWSER=1: there a missing browser fails, never skips."""
    if CHROMIUM.exists() and CHROMEDRIVER.exists():
        return
    why = "needs Debian's chromium and chromium-driver (scripts/test installs them as root)"
    if os.environ.get("CALLGATE_REQUIRE_BROWSER") == "1":
        pytest.fail(why)
    pytest.skip(why)


def fake_microphone_wav(name: str, path: Path, rate: int = 48000) -> Path:
    """The recording as the 16-bit PCM WAV chromium's fake capture device plays."""
    x = ulaw_to_float32(read_wav_ulaw(rec.RECORDINGS / f"{name}.wav"))
    t = np.arange(int(len(x) * rate / 8000)) * 8000 / rate
    y = np.interp(t, np.arange(len(x)), x)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(y, -1, 1) * 32767).astype("<i2").tobytes())
    return path


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    _need_browser()
    wav = fake_microphone_wav(RECORDING, tmp_path / "mic.wav")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'profile'}",
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                 f"--use-file-for-fake-audio-capture={wav}%noloop",
                 "--autoplay-policy=no-user-gesture-required", "--window-size=1480,900"]:
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _events(driver: Any) -> list[dict[str, Any]]:
    return list(driver.execute_script("return view.events"))


def _not_blank(driver: Any, png: bytes) -> int:
    """Distinct colours in the screenshot, decoded by the browser itself."""
    import base64

    return int(driver.execute_async_script("""
        const done = arguments[arguments.length - 1];
        const img = new Image();
        img.onload = () => {
          const c = document.createElement('canvas');
          c.width = img.width; c.height = img.height;
          const g = c.getContext('2d'); g.drawImage(img, 0, 0);
          const d = g.getImageData(0, 0, c.width, c.height).data;
          const seen = new Set();
          for (let i = 0; i < d.length; i += 4 * 7) seen.add((d[i] << 16) | (d[i+1] << 8) | d[i+2]);
          done(seen.size);
        };
        img.src = 'data:image/png;base64,' + arguments[0];
    """, base64.b64encode(png).decode()))


def test_the_pages_mu_law_is_g711(browser: Any, served: Served) -> None:
    """The page's mu-law codec against the gateway's (audio/_codec.py)."""
    from audio import float32_to_pcm16, pcm16_to_ulaw

    browser.get(served.base + "/console")
    ramp = np.linspace(-1, 1, 4001).astype(np.float32)
    ramp = np.concatenate([ramp, ramp * 0.01])  # the quiet codes too
    codes = browser.execute_script(
        "return Array.from(mulawEncode(new Float32Array(arguments[0])))", ramp.tolist())
    ours = np.frombuffer(pcm16_to_ulaw(float32_to_pcm16(ramp)), dtype=np.uint8)
    assert np.array_equal(np.array(codes, dtype=np.uint8), ours)
    table = browser.execute_script("return Array.from(MULAW_DECODE)")
    assert np.allclose(table, ulaw_to_float32(bytes(range(256))), atol=1e-6)


@pytest.mark.slow
def test_console_call_with_a_recorded_barge_in(browser: Any, served: Served,
                                               tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60)
    browser.get(served.base + "/console")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#agent option"))
    browser.find_element(By.ID, "call").click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "status"), "in call with support"))

    # The greeting: its text, node and flag in the conversation.
    greeting = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#conversation li.bot"))
    assert "bot [main, interruptible]" in greeting[0].text
    assert "Thanks for calling Acme" in greeting[0].text
    # The recorded caller talks over it: cleared at once, the pause and its latency shown.
    paused = wait.until(lambda d: d.find_elements(
        By.CSS_SELECTOR, '#events tr[data-type="bot_utterance_paused"]'))
    assert "ms after the caller started" in paused[0].text
    assert wait.until(lambda d: d.find_elements(
        By.CSS_SELECTOR, '#events tr[data-type="barge_in"]'))
    transcript = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#conversation li.caller"))
    assert "caller:" in transcript[0].text and len(transcript[0].text) > len("caller: ")
    # The agent answers it.
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#conversation li.bot")) >= 2)

    events = _events(browser)
    by_type = {e.get("type"): e for e in events}
    clear = next(e for e in events if e.get("type") == "clear_sent")
    assert clear["reason"] == "barge_in" and 0 < clear["t_ms"] - clear["onset_ms"] < 1000
    # The page echoed the greeting's marks as it played it: the gateway knows what was heard.
    assert by_type["bot_utterance_paused"]["heard_ms"] > 1000
    assert by_type["bot_utterance_paused"]["heard_text"].startswith("Thanks for calling")
    onsets = [e for e in events if e.get("what") == "onset_to_clear"]
    assert onsets and onsets[0]["ms"] == round(clear["t_ms"] - clear["onset_ms"], 1)
    # Twilio's rules, as the page keeps them: every mark echoed, those of audio the clear
    # dropped at once (the gateway keeps up to 240 ms queued, so some were pending).
    # (The gateway sends a chunk's media and its mark as two frames: while the answer streams,
    # a read can fall between them, so wait for a read with every pair complete.)
    def paired(d: Any) -> dict[str, int] | None:
        s = d.execute_script("return callgateCall.stats")
        return s if s["media"] == s["marks"] else None

    stats = wait.until(paired)
    assert stats["clears"] >= 1
    assert stats["echoedOnClear"] > 0
    assert stats["echoedPlayed"] + stats["echoedOnClear"] <= stats["marks"]
    # ... and the page drew levels and probabilities from the ops stream.
    samples_in = browser.execute_script("return view.samplesIn.length")
    samples_out = browser.execute_script("return view.samplesOut.length")
    assert samples_in > 100 and samples_out > 50

    png = browser.get_screenshot_as_png()
    (tmp_path / "console.png").write_bytes(png)
    if os.environ.get(SCREENSHOT_ENV):
        Path(os.environ[SCREENSHOT_ENV]).write_bytes(png)
    assert _not_blank(browser, png) > 50

    # The keypad: a DTMF digit, which stops the interruptible answer (dtmf_interrupts).
    browser.find_element(By.CSS_SELECTOR, '#keypad button[data-digit="5"]').click()
    assert wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#events tr[data-type="dtmf"]'))
    digits = [e["digit"] for e in _events(browser) if e.get("type") == "dtmf"]
    assert digits == ["5"]
    # The answer's line shows its text as it streamed in with the audio: the worker paces the
    # answer on what the caller hears (nodes/_worker.py), so a key press that stops it may
    # leave its later sentences unsaid; what did stream is the start of the configured answer.
    fallback = ("Sorry, I can help with your balance, a payment, or getting you a person. "
                "Which would you like?")
    line = wait.until(lambda d: (d.find_elements(By.CSS_SELECTOR, "#conversation li.bot")[1]
                                 if "Sorry, I can help" in d.find_elements(
                                     By.CSS_SELECTOR, "#conversation li.bot")[1].text else None))
    said = line.text.split(":", 1)[1].strip().strip('"')
    assert said and fallback.startswith(said.rstrip(".").rstrip()), line.text

    browser.find_element(By.ID, "hangup").click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "status"),
                                                "call ended: the caller hung up"))
    ended = [e for e in _events(browser) if e.get("type") == "call_ended"]
    assert [e["reason"] for e in ended] == ["stop"]
    state = browser.execute_script(
        "return [callgateCall.media.readyState, callgateCall.ctx.state]")
    assert state == [3, "closed"]  # socket CLOSED, audio closed

    # The agent records its calls: the console call replays to the same decisions.
    call_sid = browser.execute_script("return callgateCall.placed.call_sid")
    folder = recorded_folder(served, call_sid)
    recorded = read_events(folder / f"{folder.name}.events.jsonl")
    again = asyncio.run(replay_folder(folder))
    assert decisions(again.events) == decisions(recorded)
    assert any(e["type"] == "barge_in" for e in again.events)


@pytest.mark.slow
def test_console_watches_a_call_placed_elsewhere(browser: Any, served: Served) -> None:
    """The live-calls list: a `callgate call` in progress, clicked, shows its timeline."""
    import subprocess
    import sys

    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.console.conftest import ROOT

    wait = WebDriverWait(browser, 60)
    browser.get(served.base + "/console")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#agent option"))
    caller = subprocess.Popen(
        [sys.executable, "-m", "gateway", "call", str(rec.source("barge_in_timit")),
         "--url", served.media_url, "--hold", "0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def click_the_call(d: Any) -> bool:
            try:  # the list is redrawn whenever a call starts or ends
                d.find_element(By.CSS_SELECTOR, "#calls li").click()
            except (NoSuchElementException, StaleElementReferenceException):
                return False
            return True

        wait.until(click_the_call)
        assert wait.until(lambda d: d.find_elements(
            By.CSS_SELECTOR, '#events tr[data-type="call_started"]'))
        assert wait.until(lambda d: d.find_elements(
            By.CSS_SELECTOR, '#events tr[data-type="call_ended"]'))
        out, err = caller.communicate(timeout=60)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.communicate()
    assert caller.returncode == 0, err
    sid = browser.execute_script("return view.events[0].call_sid")
    assert f"call {sid} started" in out
    assert browser.execute_script("return view.samplesIn.length") > 0
    assert browser.find_element(By.ID, "status").text == f"watching {sid}"


@pytest.mark.slow
def test_console_on_a_gateway_that_checks_signatures(browser: Any,
                                                     served_production: Served) -> None:
    """In production the page needs the ops token; with it, a console call goes through the
    signature-checking media socket on its call's token."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.console.conftest import OPS_TOKEN

    wait = WebDriverWait(browser, 60)
    browser.get(served_production.base + "/console")
    assert "ops token required" in browser.find_element(By.TAG_NAME, "body").text
    browser.get(served_production.base + f"/console?token={OPS_TOKEN}")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#agent option"))
    browser.find_element(By.ID, "call").click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "status"), "in call with support"))
    assert wait.until(lambda d: d.find_elements(
        By.CSS_SELECTOR, '#events tr[data-type="bot_utterance_paused"]'))
    browser.find_element(By.ID, "hangup").click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "status"),
                                                "call ended: the caller hung up"))
    assert not any("media socket rejected" in line for line in served_production.log)
