// "Type as it speaks": the playground's live mode over Fish Audio's WebSocket /v1/tts/live/with-timestamp.
// Text typed or pasted into its box is sent piece by piece, a word at a time at the chosen words per second;
// the audio (a streamed WAV: its header, then 16-bit PCM) plays as it arrives, and each word is highlighted
// while it is heard, from the alignment segments. Self-contained: it adds its own section to the page.
"use strict";
// ---- a MessagePack decoder (what the server sends: maps, strings, binary, numbers, nil, booleans, arrays)
function fishUnpack(buf) {
  const view = new DataView(buf), bytes = new Uint8Array(buf), utf8 = new TextDecoder();
  let at = 0;
  const str = (n) => { const s = utf8.decode(bytes.subarray(at, at + n)); at += n; return s; };
  const bin = (n) => { const b = bytes.slice(at, at + n); at += n; return b; };
  const arr = (n) => { const a = []; for (let i = 0; i < n; i++) a.push(read()); return a; };
  const map = (n) => { const m = {}; for (let i = 0; i < n; i++) { const k = read(); m[k] = read(); } return m; };
  function read() {
    const t = bytes[at++];
    if (t < 0x80) return t;
    if (t >= 0xe0) return t - 0x100;
    if ((t & 0xf0) === 0x80) return map(t & 0x0f);
    if ((t & 0xf0) === 0x90) return arr(t & 0x0f);
    if ((t & 0xe0) === 0xa0) return str(t & 0x1f);
    let v;
    switch (t) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: v = bytes[at]; at += 1; return bin(v);
      case 0xc5: v = view.getUint16(at); at += 2; return bin(v);
      case 0xc6: v = view.getUint32(at); at += 4; return bin(v);
      case 0xca: v = view.getFloat32(at); at += 4; return v;
      case 0xcb: v = view.getFloat64(at); at += 8; return v;
      case 0xcc: return bytes[at++];
      case 0xcd: v = view.getUint16(at); at += 2; return v;
      case 0xce: v = view.getUint32(at); at += 4; return v;
      case 0xcf: v = Number(view.getBigUint64(at)); at += 8; return v;
      case 0xd0: v = view.getInt8(at); at += 1; return v;
      case 0xd1: v = view.getInt16(at); at += 2; return v;
      case 0xd2: v = view.getInt32(at); at += 4; return v;
      case 0xd3: v = Number(view.getBigInt64(at)); at += 8; return v;
      case 0xd9: v = bytes[at]; at += 1; return str(v);
      case 0xda: v = view.getUint16(at); at += 2; return str(v);
      case 0xdb: v = view.getUint32(at); at += 4; return str(v);
      case 0xdc: v = view.getUint16(at); at += 2; return arr(v);
      case 0xdd: v = view.getUint32(at); at += 4; return arr(v);
      case 0xde: v = view.getUint16(at); at += 2; return map(v);
      case 0xdf: v = view.getUint32(at); at += 4; return map(v);
    }
    throw new Error(`MessagePack type 0x${t.toString(16)} is not read here`);
  }
  return read();
}

// ---- the streamed WAV the page asks for (16-bit mono PCM), read piece by piece: push(bytes: Uint8Array)
// returns {rate (Hz; 0 until the header is whole), samples (Float32Array in [-1, 1): those the piece completes)}.
// The header's chunks are walked to `data` (a LIST chunk may come first); a sample cut between two pieces
// waits for its second byte.
function wavReader() {
  let header = new Uint8Array(0), rate = 0, odd = null;
  const none = () => ({ rate, samples: new Float32Array(0) });
  function dataStart(b) {  // where the samples begin once `fmt ` and the `data` chunk's head are in b, else -1
    const view = new DataView(b.buffer, b.byteOffset, b.length);
    let found = 0;
    for (let at = 12; at + 8 <= b.length;) {
      const id = String.fromCharCode(...b.subarray(at, at + 4)), size = view.getUint32(at + 4, true);
      if (id === "data") { rate = found; return at + 8; }
      if (at + 8 + size > b.length) return -1;
      if (id === "fmt ") found = view.getUint32(at + 12, true);
      at += 8 + size + (size % 2);  // (a chunk of odd size is padded to an even one)
    }
    return -1;
  }
  return {
    push(bytes) {
      if (!rate) {
        const all = new Uint8Array(header.length + bytes.length);
        all.set(header); all.set(bytes, header.length);
        const at = dataStart(all);
        if (at < 0) { header = all; return none(); }
        if (!rate) throw new Error("the WAV stream has no fmt chunk before its data");
        bytes = all.subarray(at); header = null;
      }
      if (odd !== null) { const b = new Uint8Array(bytes.length + 1); b[0] = odd; b.set(bytes, 1); bytes = b; odd = null; }
      if (bytes.length % 2) { odd = bytes[bytes.length - 1]; bytes = bytes.subarray(0, bytes.length - 1); }
      const n = bytes.length / 2, samples = new Float32Array(n);
      const data = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
      for (let i = 0; i < n; i++) samples[i] = data.getInt16(2 * i, true) / 32768;
      return { rate, samples };
    },
  };
}

if (typeof document !== "undefined") (() => {
  // ---- the section
  const section = document.createElement("section");
  // A word is "on" while it is heard and "heard" once its end has been played.
  section.innerHTML = `
    <style>#live-words span { padding: 0 .1rem; } #live-words .on { background: #ffe27a; }
    #live-words .heard { color: #888; }</style>
    <h2 style="font-size:1.1rem;margin-top:2rem">Type as it speaks</h2>
    <p class="sub">Text is sent a word at a time over <code>/v1/tts/live/with-timestamp</code> (Fish Audio's
    WebSocket) as you type or paste it; each word lights up while it is heard.</p>
    <textarea id="live-text" placeholder="Type or paste here, before or after Start…"></textarea>
    <div class="row">
      <label>Words per second <input id="live-wps" type="number" min="0.5" max="20" step="0.5" value="3"></label>
      <button id="live-start">Start</button>
      <button id="live-finish" disabled>Finish</button>
      <button id="live-stop" disabled>Stop</button>
    </div>
    <div class="row" style="color:#444;min-height:1.4em"><span id="live-status"></span><span id="live-audio"></span></div>
    <div id="live-words" style="line-height:1.9"></div>`;
  document.body.append(section);
  const $ = (id) => document.getElementById(id);

  let ws = null, ctx = null, timer = null;  // ws: this session's socket (null: none live)
  let finishing = false; // Finish was pressed: the rest is sent, the server speaks it
  let drawing = false;   // the highlight loop runs (one at a time, while there is something to hear)
  let sent = 0;          // characters of the box already queued (by this session or an earlier one)
  let queue = [];        // words waiting for their turn
  let wav = wavReader();  // this session's audio stream
  let heard = 0;         // session seconds received (the session's clock)
  let nextAt = 0;        // audio context time where the next buffer starts
  let spans = [];        // {seq, start, end, el}: session seconds, end exclusive
  let pieces = [];       // {session, ctxAt, seconds}: how session time maps to the audio context
  const sources = new Set();  // buffers scheduled and not played out yet
  const chunks = {};     // chunk_seq -> its word elements (a later snapshot replaces them)

  const status = (s) => { $("live-status").textContent = s; };
  const buttons = () => {  // Stop also while audio is still to be heard (generation runs ahead of playback)
    const live = ws !== null;
    $("live-start").disabled = live;
    $("live-finish").disabled = !live || finishing || ws.readyState !== WebSocket.OPEN;
    $("live-stop").disabled = !live && !sources.size;
  };

  function pcm(bytes) {  // play the samples this piece of the streamed WAV completes
    const { rate, samples } = wav.push(bytes);
    const n = samples.length;
    if (!n) return;
    const buf = ctx.createBuffer(1, n, rate);
    buf.getChannelData(0).set(samples);
    const src = ctx.createBufferSource();
    src.buffer = buf; src.connect(ctx.destination);
    sources.add(src);
    src.onended = () => { sources.delete(src); buttons(); };
    nextAt = Math.max(nextAt, ctx.currentTime + 0.05);
    src.start(nextAt);
    pieces.push({ session: heard, ctxAt: nextAt, seconds: n / rate });
    nextAt += n / rate; heard += n / rate;
    $("live-audio").textContent = `${heard.toFixed(2)} s of audio received`;
  }

  function align(seq, offset, alignment) {  // replace chunk `seq`'s words with its latest snapshot
    for (const w of chunks[seq] || []) w.el.remove();
    spans = spans.filter((w) => w.seq !== seq);
    const box = $("live-words");
    chunks[seq] = alignment.segments.map((s) => {
      const el = document.createElement("span");
      el.textContent = s.text + " ";
      box.append(el);
      return { seq, start: s.start + offset, end: s.end + offset, el };
    });
    spans = spans.concat(chunks[seq]).sort((a, b) => a.start - b.start);
  }

  function sessionNow() {  // the session time heard so far (null before the first piece plays)
    const t = ctx.currentTime;
    let now = null;  // (between pieces and after the last one: where the last piece heard ended)
    for (const p of pieces) {
      if (t < p.ctxAt) break;
      now = p.session + Math.min(t - p.ctxAt, p.seconds);
    }
    return now;
  }

  function highlight() {
    const playing = ws !== null || sources.size > 0;
    const now = playing ? sessionNow() : heard;  // (the session over and its audio played: all of it heard)
    for (const w of spans) {
      w.el.classList.toggle("on", now !== null && now >= w.start && now < w.end);
      w.el.classList.toggle("heard", now !== null && now >= w.end);
    }
    drawing = playing;
    if (playing) requestAnimationFrame(highlight);
  }

  function draw() {
    if (!drawing) { drawing = true; requestAnimationFrame(highlight); }
  }

  function pump() {  // queue what was typed or pasted since; send one word per tick
    const text = $("live-text").value;
    if (text.length < sent) sent = text.length;  // edits behind the cursor are not unsaid
    const fresh = text.slice(sent);
    const cut = fresh.search(/\s\S*$/);  // hold the word being typed until a space follows it
    if (cut >= 0) {  // one piece per word, with the spaces around it (never a piece of spaces alone)
      queue.push(...(fresh.slice(0, cut + 1).match(/\s*\S+\s+/g) || []));
      sent += cut + 1;
    }
    const word = queue.shift();
    if (word && ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ event: "text", text: word }));
  }

  function cutPlayback() {  // stop what is still to be heard; the words stay as shown, none lit
    for (const src of sources) { src.onended = null; src.stop(); }
    sources.clear(); pieces = []; nextAt = 0;
    for (const w of spans) w.el.classList.remove("on");
    spans = [];
  }

  function reset() {
    clearInterval(timer); timer = null; ws = null; buttons();
  }

  $("live-start").onclick = () => {
    const voice = document.getElementById("voice");
    ctx = ctx || new (window.AudioContext || window.webkitAudioContext)();
    ctx.resume();
    cutPlayback();  // (a new session is not heard over the last one)
    queue = []; finishing = false;  // (what is in the box and not sent yet is spoken: typed before Start)
    wav = wavReader();
    heard = 0; nextAt = 0; spans = []; pieces = [];
    for (const k of Object.keys(chunks)) delete chunks[k];
    $("live-words").textContent = ""; $("live-audio").textContent = "";
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/tts/live/with-timestamp`;
    // A socket's events count only while it is this session's: a stopped one may report its close late.
    const socket = ws = new WebSocket(url);
    socket.binaryType = "arraybuffer";
    socket.onopen = () => {
      if (ws !== socket) return;
      const request = { text: "", format: "wav" };
      if (voice && voice.value) request.reference_id = voice.value;
      socket.send(JSON.stringify({ event: "start", request }));
      const wps = Math.min(20, Math.max(0.5, Number($("live-wps").value) || 3));
      timer = setInterval(pump, 1000 / wps);
      buttons(); status("live: type or paste");
      draw();
    };
    socket.onmessage = (m) => {
      if (ws !== socket || typeof m.data === "string") return;
      const e = fishUnpack(m.data);
      if (e.event === "audio") {
        if (e.audio && e.audio.length) pcm(e.audio);
        if (e.alignment) align(e.chunk_seq, e.chunk_audio_offset_sec, e.alignment);
      } else if (e.event === "finish") {
        status(e.reason === "stop" ? "finished" : `error: ${e.message || "the session failed"}`);
        reset();
      }
    };
    socket.onclose = () => { if (ws === socket) { status("disconnected"); reset(); } };
    buttons(); status("connecting…");
  };

  $("live-finish").onclick = () => {  // send the rest now, then stop: the server speaks what is left
    if (!ws || ws.readyState !== WebSocket.OPEN || finishing) return;
    const text = $("live-text").value.slice(sent);
    sent = $("live-text").value.length;
    const rest = queue.join("") + text;
    queue = [];
    clearInterval(timer); timer = null;
    finishing = true; buttons();
    if (rest) ws.send(JSON.stringify({ event: "text", text: rest }));
    ws.send(JSON.stringify({ event: "flush" }));
    ws.send(JSON.stringify({ event: "stop" }));
    status("speaking what is left…");
  };

  $("live-stop").onclick = () => {  // leave (the server aborts the session) and cut the playback
    if (ws) ws.close();
    reset(); cutPlayback(); buttons(); status("stopped");
  };
})();
