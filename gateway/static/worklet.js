// AudioWorklet processors of the callgate console (gateway/static/console.js loads them).
//
// "capture": the microphone at the context's rate -> 8 kHz float frames of 20 ms (160
// samples), low-pass filtered first (windowed sinc, cut-off 3.6 kHz) so that nothing above
// the telephone band folds back into it. console.js encodes them as mu-law.
//
// "player": the bot's audio (8 kHz floats, as the gateway sent it) played at the context's
// rate, in order, with Twilio's mark rule: a mark is reported ("played") once all the audio
// queued before it has been played. "clear" drops every sample not yet played at once and
// reports the pending marks ("cleared"), as Twilio echoes them on clear.

const TELEPHONY_RATE = 8000;
const FRAME = 160; // 20 ms at 8 kHz

class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / TELEPHONY_RATE; // input samples per output sample
    const taps = 63, fc = 3600 / sampleRate, mid = (taps - 1) / 2;
    this.h = new Float32Array(taps);
    let sum = 0;
    for (let i = 0; i < taps; i++) {
      const x = i - mid;
      const sinc = x === 0 ? 2 * fc : Math.sin(2 * Math.PI * fc * x) / (Math.PI * x);
      const w = 0.54 - 0.46 * Math.cos((2 * Math.PI * i) / (taps - 1));
      this.h[i] = sinc * w;
      sum += this.h[i];
    }
    for (let i = 0; i < taps; i++) this.h[i] /= sum;
    this.ring = taps + 2; // recent input: the taps of the newest two output positions
    this.hist = new Float32Array(this.ring);
    this.pos = 0; // samples written
    this.next = 0; // input position (fractional) of the next output sample
    this.out = new Float32Array(FRAME);
    this.n = 0;
  }
  filtered(at) { // the low-passed input at integer sample index `at` (at <= pos - 1)
    const taps = this.h.length;
    let acc = 0;
    for (let i = 0; i < taps; i++) {
      const idx = at - i;
      if (idx < 0) break;
      acc += this.h[i] * this.hist[idx % this.ring];
    }
    return acc;
  }
  process(inputs) {
    const input = inputs[0] && inputs[0][0];
    if (!input) return true;
    for (let k = 0; k < input.length; k++) {
      this.hist[this.pos % this.ring] = input[k];
      this.pos++;
      // Emit every output sample whose position (and the sample after it) is now in.
      while (this.next + 1 <= this.pos - 1) {
        const i0 = Math.floor(this.next), frac = this.next - i0;
        const v = this.filtered(i0) * (1 - frac) + this.filtered(i0 + 1) * frac;
        this.out[this.n++] = v;
        this.next += this.step;
        if (this.n === FRAME) {
          this.port.postMessage(this.out.slice(0));
          this.n = 0;
        }
      }
    }
    return true;
  }
}

class Player extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = TELEPHONY_RATE / sampleRate; // 8 kHz samples per output sample
    this.queue = []; // {audio: Float32Array} | {mark: name}
    this.at = 0; // position in queue[0].audio
    this.played = 0; // 8 kHz samples played in all
    this.port.onmessage = (e) => {
      const m = e.data;
      if (m.type === "audio") this.queue.push({ audio: m.samples });
      else if (m.type === "mark") this.queue.push({ mark: m.name });
      else if (m.type === "clear") {
        const names = this.queue.filter((x) => x.mark !== undefined).map((x) => x.mark);
        this.queue = [];
        this.at = 0;
        this.port.postMessage({ type: "cleared", names });
      }
    };
  }
  process(inputs, outputs) {
    const out = outputs[0][0];
    for (let k = 0; k < out.length; k++) {
      let v = 0;
      while (this.queue.length) {
        const head = this.queue[0];
        if (head.mark !== undefined) { // all audio before it has played
          this.port.postMessage({ type: "played", name: head.mark, played: this.played });
          this.queue.shift();
          continue;
        }
        const i = Math.floor(this.at);
        if (i >= head.audio.length) {
          this.played += head.audio.length;
          this.queue.shift();
          this.at -= head.audio.length;
          continue;
        }
        const frac = this.at - i;
        const nxt = i + 1 < head.audio.length ? head.audio[i + 1] : head.audio[i];
        v = head.audio[i] * (1 - frac) + nxt * frac;
        this.at += this.step;
        break;
      }
      out[k] = v;
    }
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    return true;
  }
}

registerProcessor("capture", Capture);
registerProcessor("player", Player);
