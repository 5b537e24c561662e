// The callgate softphone console: a call to an agent from the browser, spoken in Twilio Media
// Streams to the gateway's /twilio/media, and the call watched on its ops stream.
// No build step: plain JS, one file, served by `callgate serve` at /console.
"use strict";

const $ = (id) => document.getElementById(id);
const query = new URLSearchParams(location.search);
const opsToken = query.get("token"); // the ops token, when the gateway has one

function api(path, options = {}) {
  const headers = { "Content-Type": "application/json", ...(options.headers || {}) };
  if (opsToken) headers.Authorization = `Bearer ${opsToken}`;
  return fetch(path, { ...options, headers }).then(async (r) => {
    if (!r.ok) throw new Error(`${path}: ${r.status} ${await r.text()}`);
    return r.json();
  });
}

function wsUrl(path) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const sep = path.includes("?") ? "&" : "?";
  return `${scheme}//${location.host}${path}${opsToken ? `${sep}token=${encodeURIComponent(opsToken)}` : ""}`;
}

// -- G.711 mu-law ------------------------------------------------------------------------------
const MULAW_DECODE = new Float32Array(256);
for (let i = 0; i < 256; i++) {
  const u = ~i & 0xff;
  const t = (((u & 0x0f) << 3) + 0x84) << ((u & 0x70) >> 4);
  MULAW_DECODE[i] = ((u & 0x80) ? 0x84 - t : t - 0x84) / 32768;
}

// G.711 as audioop (the gateway's codec) does it: to 16-bit, then 14-bit (an arithmetic shift,
// so negative values floor), biased, segment and mantissa, all bits inverted.
const MULAW_SEG_END = [0x3f, 0x7f, 0xff, 0x1ff, 0x3ff, 0x7ff, 0xfff, 0x1fff];
function mulawEncode(samples) {
  const out = new Uint8Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    let pcm = Math.max(-32768, Math.min(32767, Math.round(samples[i] * 32768))) >> 2;
    let mask = 0xff;
    if (pcm < 0) { pcm = -pcm; mask = 0x7f; }
    pcm = Math.min(pcm, 8159) + 33;
    let seg = 0;
    while (seg < 8 && pcm > MULAW_SEG_END[seg]) seg++;
    out[i] = (seg >= 8 ? 0x7f : (seg << 4) | ((pcm >> (seg + 1)) & 0x0f)) ^ mask;
  }
  return out;
}

const b64encode = (bytes) => btoa(String.fromCharCode.apply(null, bytes));
function b64decode(text) {
  const bin = atob(text);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

// -- what the call looks like ------------------------------------------------------------------
const view = { events: [], samplesIn: [], samplesOut: [], endMs: 10000 };
const secs = (ms) => `${(ms / 1000).toFixed(2)} s`;

function addLine(cls, who, text) {
  const li = document.createElement("li");
  li.className = cls;
  if (who) {
    const b = document.createElement("span");
    b.className = "who";
    b.textContent = `${who}: `;
    li.appendChild(b);
  }
  li.appendChild(document.createTextNode(text));
  $("conversation").appendChild(li);
  li.scrollIntoView({ block: "nearest" });
  return li;
}

function addEventRow(e, detail) {
  const tr = document.createElement("tr");
  tr.dataset.type = e.type || e.what;
  for (const text of [secs(e.t_ms), e.type || `latency ${e.what}`, detail]) {
    const td = document.createElement("td");
    td.textContent = text;
    tr.appendChild(td);
  }
  $("events").tBodies[0].appendChild(tr);
}

const clearLatency = {};
const botLines = {}; // utterance id -> its line: the text streams in with the audio
let partialLine = null; // the caller's partial transcript while the turn is open
const ENDED_BY = { stop: "the caller hung up", hangup: "the bot hung up",
                   socket_closed: "the connection closed" };

function onOpsEvent(e) {
  view.events.push(e);
  view.endMs = Math.max(view.endMs, e.t_ms + 1000);
  const uid = e.utterance_id;
  let detail = "";
  switch (e.type) {
    case "call_started": detail = `${e.call_sid} agent ${e.agent}`; break;
    case "bot_utterance_started": {
      const flag = e.interruptible ? "interruptible" : "NOT interruptible";
      detail = `[${e.node}, ${flag}] ${e.text}`;
      botLines[uid] = addLine("bot", `bot [${e.node}, ${flag}]`, e.text);
      break;
    }
    case "clear_sent":
      if (e.onset_ms !== undefined && e.onset_ms !== null) {
        clearLatency[uid] = e.t_ms - e.onset_ms;
        detail = `${e.reason}: ${Math.round(e.t_ms - e.onset_ms)} ms after the caller's onset`;
      } else detail = e.reason;
      break;
    case "bot_utterance_paused": {
      const ms = clearLatency[uid];
      detail = `paused${ms !== undefined ? ` ${Math.round(ms)} ms after the caller started` : ""}; heard ${secs(e.heard_ms)}: "${e.heard_text || ""}"`;
      addLine("decision", "barge-in", detail);
      break;
    }
    case "bot_utterance_resumed":
      detail = `resumed from ${secs(e.heard_ms)} (backchannel or noise: no turn)`;
      addLine("decision", "resume", detail);
      break;
    case "barge_in":
      detail = `${e.reason}: the bot stops [${e.node}] after ${secs(e.heard_ms)}`;
      addLine("decision", "barge-in committed", detail);
      break;
    case "bot_utterance_interrupted":
    case "bot_utterance_finished":
      detail = `heard "${e.heard_text || ""}"`;
      break;
    case "interrupt_suppressed":
      detail = `policy ${e.policy}: the bot is not interruptible`;
      addLine("decision", "suppressed", detail);
      break;
    case "transcript":
      if (e.final === false) { // a streaming recogniser's words so far: one line, updated
        detail = `${e.text} (partial)`;
        if (partialLine) partialLine.lastChild.textContent = e.text;
        else partialLine = addLine("caller partial", "caller (hearing)", e.text);
        break;
      }
      if (partialLine) { partialLine.remove(); partialLine = null; }
      detail = `${e.text}${e.dropped ? ` (${e.dropped})` : ""}`;
      addLine("caller", "caller", detail);
      break;
    case "stt_error":
      detail = `${e.error}${e.fallback ? ` (the turn was sent by ${e.fallback} instead)` : ""}`;
      addLine("decision", "speech to text failed", detail);
      break;
    case "turn_latency": {
      const ms = (v) => (v === null || v === undefined ? "?" : `+${Math.round(v)}`);
      detail = `voice to voice ${ms(e.first_audio_ms)} ms: turn end ${ms(e.turn_end_ms)}, ` +
        `transcript ${ms(e.transcript_ms)}, first reply text ${ms(e.llm_first_text_ms)}, ` +
        `first reply audio ${ms(e.tts_first_audio_ms)}`;
      addLine("meta", "", `turn latency from the end of the caller's speech: ${detail}`);
      break;
    }
    case "dtmf": detail = e.digit; addLine("caller", "caller pressed", e.digit); break;
    case "call_ended":
      detail = `${ENDED_BY[e.reason] || e.reason} (${e.reason})`;
      addLine("meta", "", `call ended: ${detail}`);
      break;
    default: break;
  }
  if (e.kind === "latency") {
    detail = `${Math.round(e.ms)} ms`;
    if (e.what === "stop_to_bot_audio") addLine("meta", "", `turn latency from the end of the caller's speech: first bot audio +${detail}`);
  }
  const line = botLines[uid];
  if (line && e.text && e.type !== "bot_utterance_started" && line.lastChild.textContent !== e.text) {
    line.lastChild.textContent = e.text; // the whole text so far
  }
  addEventRow(e, detail);
  draw();
}

function onSample(s) {
  (s.dir === "in" ? view.samplesIn : view.samplesOut).push(s);
  view.endMs = Math.max(view.endMs, s.t_ms + 1000);
  if (!draw.pending) {
    draw.pending = true;
    requestAnimationFrame(() => { draw.pending = false; draw(); });
  }
}

const WINDOW_MS = 30000;
const MARKS = {
  bot_utterance_paused: ["#e08a00", "pause"], barge_in: ["#b3261e", "commit"],
  bot_utterance_resumed: ["#1f8a4c", "resume"], interrupt_suppressed: ["#7b3fb3", "suppressed"],
  transcript: ["#1b5fae", "text"], dtmf: ["#444", "dtmf"],
};

function draw() {
  const c = $("timeline"), g = c.getContext("2d");
  const W = c.width, H = c.height, top = 20, band = (H - top - 20) / 2;
  g.clearRect(0, 0, W, H);
  // The last 30 s of the call (all of it, for shorter calls).
  const t0 = Math.max(0, view.endMs - WINDOW_MS);
  const x = (t) => 40 + (Math.max(t, t0) - t0) / (view.endMs - t0) * (W - 50);
  const yLevel = (db, y0) => y0 + band - Math.max(0, Math.min(1, (db + 80) / 80)) * band;
  g.font = "11px sans-serif";
  g.fillStyle = "#67717c";
  g.fillText("caller", 2, top + 12);
  g.fillText("bot", 2, top + band + 12);
  for (let t = Math.ceil(t0 / 1000) * 1000; t < view.endMs; t += 1000) {
    g.fillStyle = "#dde2e7";
    g.fillRect(x(t), top, 1, 2 * band);
    g.fillStyle = "#67717c";
    g.fillText(`${t / 1000}s`, x(t) + 2, H - 6);
  }
  // bot utterances: spans from start to end/pause
  let open = {};
  for (const e of view.events) {
    if (e.type === "bot_utterance_started") open[e.utterance_id] = e.play_at_ms ?? e.t_ms;
    if (["bot_utterance_finished", "bot_utterance_interrupted", "bot_utterance_paused"].includes(e.type)
        && open[e.utterance_id] !== undefined) {
      g.fillStyle = e.interruptible === false ? "rgba(123,63,179,.10)" : "rgba(27,95,174,.08)";
      g.fillRect(x(open[e.utterance_id]), top + band, x(e.t_ms) - x(open[e.utterance_id]), band);
      delete open[e.utterance_id];
    }
    if (e.type === "bot_utterance_resumed") open[e.utterance_id] = e.t_ms;
  }
  const recentIn = view.samplesIn.filter((s) => s.t_ms >= t0);
  for (const s of recentIn) {
    if (s.passes) {
      g.fillStyle = "rgba(31,138,76,.12)";
      g.fillRect(x(s.t_ms - 32), top, x(s.t_ms) - x(s.t_ms - 32) + 0.5, band);
    }
    g.fillStyle = "#1f8a4c";
    const y = yLevel(s.level_db, top);
    g.fillRect(x(s.t_ms - 32), y, Math.max(1, x(s.t_ms) - x(s.t_ms - 32)), top + band - y);
  }
  g.strokeStyle = "#000";
  g.beginPath();
  recentIn.forEach((s, i) => {
    const px = x(s.t_ms), py = top + band - s.prob * band;
    if (i) g.lineTo(px, py); else g.moveTo(px, py);
  });
  g.stroke();
  g.fillStyle = "#1b5fae";
  for (const s of view.samplesOut) {
    if (s.t_ms < t0) continue;
    const y = yLevel(s.level_db, top + band);
    g.fillRect(x(s.t_ms), y, Math.max(1, x(s.t_ms + s.ms) - x(s.t_ms)), top + 2 * band - y);
  }
  for (const e of view.events) {
    const m = MARKS[e.type];
    if (!m || e.t_ms < t0) continue;
    g.fillStyle = m[0];
    g.fillRect(x(e.t_ms), top, 2, 2 * band);
    g.fillText(m[1], x(e.t_ms) + 3, top - 6);
  }
}

// -- the call ----------------------------------------------------------------------------------
let call = null;

function setStatus(state, text) {
  $("status").dataset.state = state;
  $("status").textContent = text;
}

async function placeCall() {
  $("call").disabled = true;
  if (watching) { watching.close(); watching = null; }
  resetView();
  try {
    const placed = await api("/console/call", {
      method: "POST",
      body: JSON.stringify({ agent: $("to").value ? undefined : $("agent").value,
                             to: $("to").value || undefined }),
    });
    call = { placed, seq: 1, chunk: 0, ended: false,
             stats: { media: 0, marks: 0, clears: 0, echoedPlayed: 0, echoedOnClear: 0 } };
    window.callgateCall = call; // for tests and the curious
    setStatus("dialing", `calling ${placed.agent}...`);
    // The ops stream first, so the call is watched from its first event.
    const ops = new WebSocket(wsUrl(placed.events_path));
    call.ops = ops;
    ops.onmessage = (m) => {
      onOpsMessage(m);
      const e = JSON.parse(m.data);
      if (e.type === "call_ended") finish(`call ended: ${ENDED_BY[e.reason] || e.reason}`);
    };
    await new Promise((ok, fail) => { ops.onopen = ok; ops.onerror = () => fail(new Error("ops stream refused")); });

    if (!navigator.mediaDevices || !window.AudioWorkletNode) {
      throw new Error("the browser gives the microphone only to secure pages: open the console " +
                      "over https, or on localhost");
    }
    const ctx = new AudioContext();
    call.ctx = ctx;
    await ctx.audioWorklet.addModule("/console/static/worklet.js");
    const mic = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: false, autoGainControl: false, channelCount: 1 },
    });
    call.mic = mic;
    const capture = new AudioWorkletNode(ctx, "capture", { numberOfOutputs: 1 });
    const player = new AudioWorkletNode(ctx, "player", { numberOfInputs: 0, outputChannelCount: [1] });
    const mute = ctx.createGain();
    mute.gain.value = 0; // the capture node must be pulled; it makes no sound
    ctx.createMediaStreamSource(mic).connect(capture).connect(mute).connect(ctx.destination);
    player.connect(ctx.destination);
    call.player = player;
    await ctx.resume();

    const media = new WebSocket(wsUrl(placed.media_path));
    call.media = media;
    const send = (obj) => { if (media.readyState === WebSocket.OPEN) media.send(JSON.stringify(obj)); };
    call.send = send;
    media.onmessage = (m) => {
      const msg = JSON.parse(m.data);
      if (msg.event === "media") {
        call.stats.media++;
        const bytes = b64decode(msg.media.payload);
        const samples = new Float32Array(bytes.length);
        for (let i = 0; i < bytes.length; i++) samples[i] = MULAW_DECODE[bytes[i]];
        player.port.postMessage({ type: "audio", samples }, [samples.buffer]);
      } else if (msg.event === "mark") {
        call.stats.marks++;
        player.port.postMessage({ type: "mark", name: msg.mark.name });
      } else if (msg.event === "clear") {
        call.stats.clears++;
        player.port.postMessage({ type: "clear" });
      }
    };
    const echo = (name) => send({ event: "mark", sequenceNumber: String(call.seq++),
                                  streamSid: placed.stream_sid, mark: { name } });
    player.port.onmessage = (m) => {
      if (m.data.type === "played") { call.stats.echoedPlayed++; echo(m.data.name); }
      else if (m.data.type === "cleared") {
        call.stats.echoedOnClear += m.data.names.length;
        m.data.names.forEach(echo);
      }
    };
    media.onclose = () => finish(call.hungUp ? "call ended: the caller hung up"
                                              : "the gateway closed the call");
    await new Promise((ok, fail) => { media.onopen = ok; media.onerror = () => fail(new Error("media socket refused")); });
    send({ event: "connected", protocol: "Call", version: "1.0.0" });
    send({ event: "start", sequenceNumber: String(call.seq++), streamSid: placed.stream_sid,
           start: { accountSid: placed.account_sid, streamSid: placed.stream_sid,
                    callSid: placed.call_sid, tracks: ["inbound"],
                    mediaFormat: { encoding: "audio/x-mulaw", sampleRate: 8000, channels: 1 },
                    customParameters: { token: placed.token, agent: placed.agent,
                                        from: placed.from, to: placed.to } } });
    capture.port.onmessage = (m) => {
      if (call.ended) return;
      call.chunk++;
      send({ event: "media", sequenceNumber: String(call.seq++), streamSid: placed.stream_sid,
             media: { track: "inbound", chunk: String(call.chunk),
                      timestamp: String((call.chunk - 1) * 20), payload: b64encode(mulawEncode(m.data)) } });
    };
    setStatus("in-call", `in call with ${placed.agent}`);
    $("hangup").disabled = false;
  } catch (err) {
    setStatus("ended", `call failed: ${err.message}`);
    teardown();
    $("call").disabled = false;
  }
}

function hangUp() {
  if (!call || call.ended) return;
  const p = call.placed;
  call.send({ event: "stop", sequenceNumber: String(call.seq++), streamSid: p.stream_sid,
              stop: { accountSid: p.account_sid, callSid: p.call_sid } });
  call.hungUp = true;
  $("hangup").disabled = true;
  setStatus("ended", "hanging up...");
}

function finish(text) {
  if (!call || call.ended) return;
  call.ended = true;
  if (text) setStatus("ended", text);
  teardown();
  $("hangup").disabled = true;
  $("call").disabled = false;
}

function teardown() {
  if (!call) return;
  if (call.mic) call.mic.getTracks().forEach((t) => t.stop());
  if (call.ctx) call.ctx.close();
  if (call.media && call.media.readyState <= WebSocket.OPEN) call.media.close();
  // The ops stream ends by itself after call_ended; close it if the call never started.
  if (call.ops && !view.events.some((e) => e.type === "call_ended")) call.ops.close();
}

function pressKey(digit) {
  if (!call || call.ended || !call.send) return;
  call.send({ event: "dtmf", streamSid: call.placed.stream_sid, sequenceNumber: String(call.seq++),
              dtmf: { track: "inbound_track", digit } });
}

function resetView() {
  $("conversation").replaceChildren();
  $("events").tBodies[0].replaceChildren();
  Object.assign(view, { events: [], samplesIn: [], samplesOut: [], endMs: 10000 });
  draw();
}

function onOpsMessage(m) {
  const e = JSON.parse(m.data);
  if (e.kind === "sample") onSample(e);
  else if (e.kind === "event" || e.kind === "latency") onOpsEvent(e);
}

// Watch a call placed elsewhere (a phone, `callgate call`): its timeline, no audio.
let watching = null;
function watchCall(callSid) {
  if (call && !call.ended) return; // the console's own call has the view
  if (watching) watching.close();
  resetView();
  watching = new WebSocket(wsUrl(`/ops/calls/${callSid}/events`));
  watching.onmessage = onOpsMessage;
  setStatus("watching", `watching ${callSid}`);
}

function watchLiveCalls() {
  const ws = new WebSocket(wsUrl("/ops/live"));
  ws.onmessage = (m) => {
    const msg = JSON.parse(m.data);
    $("calls").replaceChildren(...msg.calls.map((c) => {
      const li = document.createElement("li");
      li.dataset.callSid = c.call_sid;
      li.textContent = `${c.call_sid} (${c.agent})`;
      li.title = "watch this call";
      li.onclick = () => watchCall(c.call_sid);
      return li;
    }));
  };
}

async function init() {
  for (const d of "123456789*0#") {
    const b = document.createElement("button");
    b.textContent = d;
    b.dataset.digit = d;
    b.onclick = () => pressKey(d);
    $("keypad").appendChild(b);
  }
  $("call").onclick = placeCall;
  $("hangup").onclick = hangUp;
  try {
    const { agents } = await api("/console/agents");
    for (const a of agents) $("agent").appendChild(new Option(a, a));
    watchLiveCalls();
  } catch (err) {
    setStatus("ended", err.message);
  }
  draw();
}

init();
