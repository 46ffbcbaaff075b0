// batchserve's live page: one pane per batching mode, fed by the scheduler's event stream (docs/events.md).
// Plain browser JavaScript, no build step and no library: the machines it runs on are offline.
"use strict";

(() => {
  const KEY_STORAGE = "batchserve.apiKey";
  const MODES_PATH = "/v1/compare/modes"; // which modes, under which prefix (both commands)
  // The server sends a workload to every pane itself and streams the answers back on one connection (both commands).
  const WORKLOAD_PATH = "/v1/compare/workload";
  // Every mode's events in one stream (both commands); without text, which the page does not show (its own
  // requests' text comes from their own streams) and the server then need not decode.
  const EVENTS_PATH = "/v1/events?include_text=false";
  const MAX_BOXES_PER_MODE = 48; // older request boxes leave the DOM, so hundreds of requests stay readable
  // What the lanes keep: every bar of the last workload's run, from its send to its end, until the next workload
  // starts ("fit the last workload" compresses time to span it, however long it ran); anything else for keepS
  // seconds (`?keep_s=` in the page's address, for tools and tests; the default covers the widest live window).
  const DEFAULT_KEEP_S = 180;
  const MAX_KEEP_S = 3600;
  const MAX_BARS_PER_SEAT = 4096; // a bound whatever the traffic (a paused page too): past it the oldest go first
  const MAX_QUEUE_POINTS = 16384;
  const SEGMENT_GAP_S = 0.5; // a seat idle longer than this between two steps shows a gap, not one long bar
  const TOKEN_RATE_WINDOW_S = 5;
  const TTFT_SAMPLES = 1000;
  const LIVE_REQUESTS = 4096; // requests in flight we keep times for (a bound, should events go missing)
  const RECENT_REQUESTS = 512;
  const MIN_SEND_INTERVAL_MS = 1000; // client-side rate limit on the send button
  const DEFAULT_MAX_RATE = 20; // requests per second per mode, unless the server says otherwise
  const DEFAULT_MAX_TOKENS = 1024; // per request, unless the server says otherwise
  const DEFAULT_MAX_DELAY_S = 120; // the last request leaves at most this long after the send, unless the server says
  const RECONNECT_MS = 2000;
  const FIGURES_EVERY_MS = 250;
  const PHASES = new Set(["prefill", "decode", "held", "idle"]);

  const page = {
    key: sessionStorage.getItem(KEY_STORAGE) || "",
    modes: [], // ModeView per mode, in the server's order
    views: new Map(), // mode name -> ModeView
    maxPrompts: 32,
    maxRate: DEFAULT_MAX_RATE,
    maxTokens: DEFAULT_MAX_TOKENS,
    maxDelay: DEFAULT_MAX_DELAY_S,
    clockOffset: null, // server "t" minus the page clock (s): the most recent events' least delayed estimate
    workload: null, // {startT, endT, pending}
    keepS: keepSeconds(),
    frozenNow: null, // the lanes' now while "pause" is ticked
    lastSendMs: -Infinity,
    nextBoxId: 0,
  };

  const $ = (selector, root = document) => root.querySelector(selector);

  function keepSeconds() {
    const raw = new URLSearchParams(location.search).get("keep_s");
    const value = Number(raw);
    return raw !== null && Number.isFinite(value) && value > 0 ? Math.min(value, MAX_KEEP_S) : DEFAULT_KEEP_S;
  }

  function headers(extra = {}) {
    return page.key ? { ...extra, Authorization: `Bearer ${page.key}` } : extra;
  }

  function setStatus(state, text) {
    const status = $("#status");
    status.dataset.state = state;
    status.textContent = text;
  }

  // ---- the server clock: events carry "t" (seconds on the server's monotonic clock) ----
  function observeServerTime(t) {
    const estimate = t - performance.now() / 1000;
    // Delivery only ever delays an event, so the largest estimate is the closest; re-anchor if the server restarted.
    if (page.clockOffset === null || estimate > page.clockOffset || page.clockOffset - estimate > 30) {
      page.clockOffset = estimate;
    }
  }

  function serverNow() {
    return page.clockOffset === null ? 0 : performance.now() / 1000 + page.clockOffset;
  }

  // ---- reading server-sent events with fetch, so the API key goes in a header, never in a URL ----
  async function readSse(response, onEvent) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let type = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith(":")) continue; // a comment: keep-alive ping
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "event") type = text;
          else if (field === "data") data.push(text);
        }
        if (data.length) onEvent(type, data.join("\n"));
      }
    }
  }

  async function readEventStream(url, onEvent, signal) {
    const response = await fetch(url, { headers: headers({ Accept: "text/event-stream" }), signal });
    if (response.status === 401) throw new KeyNeeded();
    if (!response.ok || !response.body) throw new Error(`${url}: HTTP ${response.status}`);
    await readSse(response, onEvent);
  }

  class KeyNeeded extends Error {}

  // ---- one mode's pane: lanes from step events, figures, and this page's request boxes ----
  class ModeView {
    constructor(info) {
      this.mode = info.mode;
      this.prefix = info.prefix || "";
      this.seats = info.seats || 1;
      const section = $("#pane-template").content.firstElementChild.cloneNode(true);
      section.id = `pane-${this.mode}`;
      section.dataset.mode = this.mode;
      $(".pane-title", section).textContent = this.mode;
      this.detail = $(".pane-detail", section);
      this.canvas = $("canvas", section);
      this.canvas.id = `lanes-${this.mode}`;
      this.boxes = $(".requests", section);
      this.boxes.id = `requests-${this.mode}`;
      this.figures = {};
      for (const dd of section.querySelectorAll("[data-figure]")) {
        dd.id = `${dd.dataset.figure}-${this.mode}`;
        dd.dataset.mode = this.mode;
        this.figures[dd.dataset.figure] = dd;
      }
      this.section = section;
      this.reset();
      this.describe(info);
    }

    reset() {
      this.segments = Array.from({ length: this.seats }, () => []); // per seat: {t0, t1, phase, rid}
      this.open = new Array(this.seats).fill(null);
      this.queue = []; // [t, waiting] after each request event
      this.tokenSamples = []; // [t, output tokens]
      this.ttfts = [];
      this.requests = new Map(); // request id -> its lifecycle times, from request events
      this.recent = new Map(); // the same for released requests, the latest RECENT_REQUESTS of them
      this.heldSeatSteps = 0;
      this.draftSteps = 0; // speculation: steps that verified drafts, and the draft tokens they accepted
      this.acceptedTokens = 0;
      this.finished = 0;
      this.unseenWaiting = 0; // requests a hello said were waiting, queued before we subscribed
    }

    describe(info) {
      const parts = [`${this.seats} seats`];
      // A plug-in policy: its import path, and the mode whose seats and settings it runs with.
      if (info.policy) parts.unshift(`policy ${info.policy} on ${info.policy_mode}'s seats`);
      if (info.max_batch_size != null) parts.push(`batch ${info.max_batch_size}`);
      if (info.batch_timeout_ms != null) parts.push(`timeout ${info.batch_timeout_ms} ms`);
      if (info.batch_window_ms != null) parts.push(`leaves full or at a tick every ${info.batch_window_ms} ms`);
      if (info.max_num_batched_tokens != null) parts.push(`step budget ${info.max_num_batched_tokens} tokens`);
      if (info.speculative_tokens != null) {
        parts.push(`speculation: up to ${info.speculative_tokens} drafts (${info.draft_length})`);
      }
      if (this.prefix) parts.push(`API at ${this.prefix}/v1`);
      this.detail.textContent = parts.join(" · ");
    }

    // -- events --
    onHello(data) {
      this.section.dataset.live = "true"; // its events flow: a workload sent now shows from its start
      if (data.seats && data.seats !== this.seats) {
        this.seats = data.seats;
        this.reset();
      }
      this.describe(data);
      this.closeAll();
      // A fresh start (first, or after events were dropped): the seated requests are the hello's lanes; any
      // other we thought seated was released while we were not looking.
      const seated = new Set();
      for (const lane of data.lanes || []) {
        if (lane.request_id == null || !PHASES.has(lane.phase) || lane.seat < 0 || lane.seat >= this.seats) continue;
        seated.add(lane.request_id);
        const record = this.record(lane.request_id);
        record.seat = lane.seat;
        record.admitted ??= data.t;
        if (lane.phase === "held") record.finished ??= data.t;
        this.open[lane.seat] = { t0: data.t, t1: data.t, phase: lane.phase, rid: lane.request_id };
        this.segments[lane.seat].push(this.open[lane.seat]);
      }
      let waiting = 0;
      for (const record of [...this.requests.values()]) {
        if (seated.has(record.id)) continue;
        if (record.admitted != null || record.finished != null) this.retire(record, data.t);
        else if (record.queued != null) waiting += 1;
      }
      this.unseenWaiting = Math.max(0, (data.waiting || 0) - waiting);
      this.queue.push([data.t, this.counts().waiting]);
    }

    closeAll() {
      this.open.fill(null);
    }

    onStep(data) {
      const t0 = data.t; // the step's start
      const t1 = t0 + (data.duration_ms || 0) / 1000;
      const occupied = new Array(this.seats).fill(null);
      for (const lane of data.lanes) {
        if (lane.seat >= 0 && lane.seat < this.seats && PHASES.has(lane.phase)) occupied[lane.seat] = lane;
      }
      for (let seat = 0; seat < this.seats; seat += 1) {
        const lane = occupied[seat];
        const current = this.open[seat];
        if (!lane) {
          this.open[seat] = null;
          continue;
        }
        if (current && current.rid === lane.request_id && current.phase === lane.phase && t0 - current.t1 < SEGMENT_GAP_S) {
          current.t1 = t1;
        } else {
          const start = current && current.rid === lane.request_id ? current.t1 : t0; // no sliver between phases
          this.open[seat] = { t0: start, t1, phase: lane.phase, rid: lane.request_id };
          this.segments[seat].push(this.open[seat]);
        }
      }
      this.heldSeatSteps += data.held || 0;
      if (data.drafted) {
        this.draftSteps += 1;
        this.acceptedTokens += data.accepted || 0;
      }
      if (data.generated) this.tokenSamples.push([t1, data.generated]);
    }

    onRequest(data) {
      const id = data.request_id;
      const record = this.record(id);
      const firstSight = record.queued == null && record.admitted == null && record.finished == null;
      if (firstSight && data.event !== "queued" && this.unseenWaiting > 0 && data.event !== "rejected") {
        this.unseenWaiting -= 1; // one of the requests the hello counted as waiting
      }
      record[data.event] = data.t;
      if (data.seat != null) record.seat = data.seat;
      if (data.outcome) record.outcome = data.outcome;
      if (data.event === "queued") record.promptTokens = data.prompt_tokens;
      if (data.event === "admitted") record.cachedTokens = data.cached_tokens || 0;
      if (data.event === "first_token" && data.ttft_ms != null) {
        this.ttfts.push(data.ttft_ms / 1000);
        if (this.ttfts.length > TTFT_SAMPLES) this.ttfts.shift();
      }
      if (data.event === "finished") this.finished += 1;
      if (record.box) applyServerTimes(record.box, record);
      if (data.event === "released" || data.event === "rejected") this.retire(record);
      // The queue strip follows request events, not steps: a dynamic batch waiting for its bus runs no step.
      this.queue.push([data.t, this.counts().waiting]);
    }

    // Its life is over: keep it among the recent ones (a box may link to it late), bounded.
    retire(record, t) {
      if (t != null) record.released ??= t;
      this.requests.delete(record.id);
      this.recent.set(record.id, record);
      if (this.recent.size > RECENT_REQUESTS) this.recent.delete(this.recent.keys().next().value);
    }

    // Queue and seats now, from the requests' lifecycle events (a step event says nothing once the mode is idle).
    counts() {
      let waiting = this.unseenWaiting;
      let running = 0;
      let held = 0;
      for (const record of this.requests.values()) {
        if (record.admitted != null) {
          running += 1;
          if (record.finished != null) held += 1;
        } else if (record.queued != null && record.finished == null) {
          waiting += 1;
        }
      }
      return { waiting, running, held };
    }

    record(id) {
      let record = this.requests.get(id) || this.recent.get(id);
      if (!record) {
        record = { id };
        this.requests.set(id, record);
        if (this.requests.size > LIVE_REQUESTS) this.requests.delete(this.requests.keys().next().value);
      }
      return record;
    }

    // A box learns its request's id from its stream's first chunk; the event stream may know it already.
    link(box, id) {
      box.dataset.requestId = id;
      const record = this.record(id);
      record.box = box;
      applyServerTimes(box, record);
    }

    // Drop what no window shows any more: a bar or queue stretch is kept while it meets one of `spans` (keptSpans).
    prune(now, spans) {
      const kept = (t0, t1) => spans.some(([from, until]) => t1 >= from && t0 <= until);
      const bars = new Map(); // request id -> its bars kept
      let total = 0;
      for (let seat = 0; seat < this.seats; seat += 1) {
        const list = this.segments[seat].filter((segment) => kept(segment.t0, segment.t1));
        if (list.length > MAX_BARS_PER_SEAT) list.splice(0, list.length - MAX_BARS_PER_SEAT);
        this.segments[seat] = list;
        total += list.length;
        for (const segment of list) bars.set(segment.rid, (bars.get(segment.rid) || 0) + 1);
      }
      // A queue point holds until the next one, so the one before a kept stretch stays with it.
      this.queue = this.queue.filter(([t], i, all) => kept(t, i + 1 < all.length ? all[i + 1][0] : Infinity));
      if (this.queue.length > MAX_QUEUE_POINTS) this.queue.splice(0, this.queue.length - MAX_QUEUE_POINTS);
      let stale = 0;
      while (stale < this.tokenSamples.length && this.tokenSamples[stale][0] < now - TOKEN_RATE_WINDOW_S) stale += 1;
      if (stale) this.tokenSamples.splice(0, stale);
      // Hooks for tools and tests: what the lanes hold, and each box's request's share of it.
      this.canvas.dataset.keptBars = total;
      this.canvas.dataset.keptRequests = bars.size;
      for (const box of this.boxes.children) {
        if (box.dataset.requestId) box.dataset.laneBars = bars.get(box.dataset.requestId) || 0;
      }
    }

    // -- figures beside the lanes --
    updateFigures(now) {
      const f = this.figures;
      const counts = this.counts();
      f.waiting.textContent = counts.waiting;
      f.running.textContent = counts.running;
      f["held-now"].textContent = counts.held;
      let tokens = 0;
      for (const [t, n] of this.tokenSamples) if (t >= now - TOKEN_RATE_WINDOW_S) tokens += n;
      f["tokens-per-s"].textContent = (tokens / TOKEN_RATE_WINDOW_S).toFixed(1);
      const sorted = [...this.ttfts].sort((a, b) => a - b);
      f["ttft-p50"].textContent = sorted.length ? formatSeconds(quantile(sorted, 0.5)) : "–";
      f["ttft-p99"].textContent = sorted.length ? formatSeconds(quantile(sorted, 0.99)) : "–";
      f["held-seat-steps"].textContent = this.heldSeatSteps;
      f["held-seat-steps"].dataset.value = this.heldSeatSteps;
      const perStep = this.draftSteps ? (this.acceptedTokens / this.draftSteps).toFixed(2) : "–";
      f["accepted-per-step"].textContent = perStep;
      f["accepted-per-step"].dataset.value = this.acceptedTokens;
      f.finished.textContent = this.finished;
    }

    // -- lanes: a queue strip, then one row per seat, time running left to right --
    // `origin`: where the axis reads 0 s (now, when live; the send, when showing a workload).
    draw(tStart, tEnd, origin) {
      const canvas = this.canvas;
      const queueH = 26;
      const axisH = 16;
      const laneH = Math.max(3, Math.min(22, Math.floor(320 / this.seats)));
      const cssW = canvas.clientWidth || 600;
      const cssH = queueH + laneH * this.seats + axisH;
      const ratio = window.devicePixelRatio || 1;
      if (canvas.width !== Math.round(cssW * ratio) || canvas.height !== Math.round(cssH * ratio)) {
        canvas.width = Math.round(cssW * ratio);
        canvas.height = Math.round(cssH * ratio);
        canvas.style.height = `${cssH}px`;
      }
      const ctx = canvas.getContext("2d");
      ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
      ctx.clearRect(0, 0, cssW, cssH);
      const span = Math.max(tEnd - tStart, 1e-3);
      const x = (t) => ((t - tStart) / span) * cssW;

      // Queue strip: requests waiting for a seat, scaled to the window's largest count.
      ctx.fillStyle = colors.laneBackground;
      ctx.fillRect(0, 0, cssW, queueH - 4);
      let peak = 0;
      for (let i = 0; i < this.queue.length; i += 1) {
        const [t, n] = this.queue[i];
        const next = i + 1 < this.queue.length ? this.queue[i + 1][0] : tEnd;
        if (next >= tStart && t <= tEnd && n > peak) peak = n;
      }
      if (peak > 0) {
        ctx.fillStyle = colors.waiting;
        for (let i = 0; i < this.queue.length; i += 1) {
          const [t, n] = this.queue[i];
          const next = i + 1 < this.queue.length ? this.queue[i + 1][0] : tEnd;
          if (next < tStart || !n) continue;
          const h = ((queueH - 6) * n) / peak;
          ctx.fillRect(x(t), queueH - 4 - h, Math.max(1, x(next) - x(t)), h);
        }
      }
      ctx.fillStyle = colors.text;
      ctx.font = "11px system-ui, sans-serif";
      ctx.textAlign = "right";
      ctx.fillText(`queue, max ${peak}`, cssW - 4, 12);
      ctx.textAlign = "left";

      // Seat lanes. The canvas's data-drawn-<phase> attributes count the bars in view (for tests and tools).
      const drawn = { prefill: 0, decode: 0, held: 0, idle: 0, cached: 0 };
      const drawnRequests = new Set();
      for (let seat = 0; seat < this.seats; seat += 1) {
        const y = queueH + seat * laneH;
        ctx.fillStyle = seat % 2 ? colors.laneBackground : colors.laneBackgroundAlt;
        ctx.fillRect(0, y, cssW, laneH);
        for (const segment of this.segments[seat]) {
          if (segment.t1 < tStart || segment.t0 > tEnd) continue;
          drawn[segment.phase] += 1;
          drawnRequests.add(segment.rid);
          ctx.fillStyle = colors[segment.phase];
          const x0 = x(Math.max(segment.t0, tStart));
          const width = Math.max(1, x(segment.t1) - x0);
          const top = y + (laneH > 6 ? 1 : 0);
          const height = laneH > 6 ? laneH - 2 : laneH;
          ctx.fillRect(x0, top, width, height);
          // A prefill read partly from the prefix cache: its cached share of the prompt, as a band on top, on whole
          // pixels and at least 2 wide, so that a short prefill's band still shows (a 1-pixel band at a fractional x
          // blended into the bar's colour and was lost).
          const record = segment.phase === "prefill" ? this.requests.get(segment.rid) || this.recent.get(segment.rid) : null;
          if (record && record.cachedTokens > 0 && record.promptTokens > 0) {
            drawn.cached += 1;
            ctx.fillStyle = colors.cached;
            const band = Math.max(2, Math.round((width * record.cachedTokens) / record.promptTokens));
            ctx.fillRect(Math.round(x0), top, band, Math.max(2, height / 3));
          }
        }
      }

      for (const [phase, count] of Object.entries(drawn)) canvas.dataset[`drawn${phase[0].toUpperCase()}${phase.slice(1)}`] = count;
      canvas.dataset.drawnRequests = drawnRequests.size;

      // Time axis: seconds before now (or before the window's end).
      const axisY = queueH + laneH * this.seats;
      ctx.fillStyle = colors.text;
      const step = niceStep(span / 6);
      for (let t = origin + Math.ceil((tStart - origin) / step) * step; t <= tEnd; t += step) {
        const px = x(t);
        ctx.fillRect(px, axisY, 1, 4);
        const label = (t - origin).toFixed(step < 1 ? 1 : 0);
        ctx.fillText(`${t > origin ? "+" : ""}${label} s`, Math.min(px + 2, cssW - 34), axisY + 13);
      }
      if (page.workload && page.workload.startT >= tStart) {
        ctx.fillStyle = colors.marker;
        ctx.fillRect(x(page.workload.startT), queueH, 1, laneH * this.seats);
      }
    }
  }

  function quantile(sorted, q) {
    return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
  }

  function formatSeconds(s) {
    return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
  }

  function niceStep(raw) {
    const power = 10 ** Math.floor(Math.log10(raw));
    return [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
  }

  const colors = {};
  function readColors() {
    const style = getComputedStyle(document.documentElement);
    const read = (name) => style.getPropertyValue(name).trim();
    Object.assign(colors, {
      waiting: read("--waiting"),
      prefill: read("--prefill"),
      cached: read("--cached"),
      decode: read("--decode"),
      held: read("--held"),
      idle: read("--idle"),
      laneBackground: read("--lane-bg"),
      laneBackgroundAlt: read("--lane-bg-alt"),
      text: read("--muted"),
      marker: read("--marker"),
    });
  }

  // ---- the event feed ----
  function dispatch(type, raw, fallbackMode) {
    let data;
    try {
      data = JSON.parse(raw);
    } catch {
      return;
    }
    if (typeof data.t === "number") observeServerTime(data.t);
    const view = page.views.get(data.mode || fallbackMode);
    if (!view) return;
    if (type === "hello") {
      view.onHello(data);
      if (data.model) $("#model").textContent = data.model;
      const dropped = Number(document.body.dataset.droppedEvents || 0);
      setStatus("live", dropped ? `live (fell behind: ${dropped} events dropped, lanes have a gap)` : "live");
    } else if (type === "step") {
      view.onStep(data);
    } else if (type === "request") {
      view.onRequest(data);
    } else if (type === "lagged") {
      // The server emptied this subscriber's whole queue (every mode's events); a hello per mode follows.
      for (const each of page.modes) each.closeAll();
      document.body.dataset.droppedEvents = Number(document.body.dataset.droppedEvents || 0) + data.dropped;
      setStatus("lagged", `fell behind: ${document.body.dataset.droppedEvents} events dropped`);
    }
  }

  function subscribe(url, fallbackMode) {
    const controller = new AbortController();
    const run = async () => {
      for (;;) {
        try {
          setStatus("connecting", "connecting…");
          await readEventStream(url, (type, raw) => dispatch(type, raw, fallbackMode), controller.signal);
        } catch (error) {
          if (controller.signal.aborted) return; // replaced by a new subscription (a new key)
          if (error instanceof KeyNeeded) {
            askForKey("the event stream needs the API key");
            return;
          }
        }
        if (controller.signal.aborted) return;
        for (const view of page.modes) {
          view.closeAll();
          view.section.dataset.live = "false";
        }
        setStatus("down", "event stream closed; reconnecting…");
        await new Promise((resolve) => setTimeout(resolve, RECONNECT_MS));
      }
    };
    run();
    return controller;
  }

  // ---- sending a workload from the page, to every mode at the same moment ----
  // Plain prompts that read well in the boxes; both modes get the same ones, in the same order.
  const SHORT_PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "A week has seven days; a year has",
    "The opposite of hot is",
    "Bees make honey from",
    "The chemical symbol for gold is",
    "The first man on the moon was",
    "A triangle has three sides and a square has",
    "The fastest land animal is",
    "Photosynthesis turns sunlight into",
    "The author of Hamlet is",
  ];
  const LONG_PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle. Once upon a time,",
    "Explain in detail, step by step, how a bicycle works, starting with the pedals.",
    "Describe a walk through a busy market in a small coastal town, from morning to evening.",
  ];

  // The workload: what each request asks and when it leaves (seconds after the send), the same for every mode.
  function buildWorkload(kind, count, rate, shortTokens, longTokens) {
    const specs = [];
    for (let i = 0; i < count; i += 1) {
      let long;
      if (kind === "hostage") long = i === 0;
      else if (kind === "mixed") long = i % 4 === 3;
      else long = false;
      const maxTokens = kind === "uniform" ? Math.round((shortTokens + longTokens) / 2) : long ? longTokens : shortTokens;
      const prompt = long ? LONG_PROMPTS[i % LONG_PROMPTS.length] : SHORT_PROMPTS[i % SHORT_PROMPTS.length];
      specs.push({ index: i, kind: kind === "uniform" ? "uniform" : long ? "long" : "short", maxTokens, prompt,
        delay: rate > 0 ? i / rate : 0 });
    }
    return specs;
  }

  function readWorkloadForm() {
    const kind = $("#workload-kind").value;
    const count = Number($("#workload-count").value);
    const rate = Number($("#workload-rate").value);
    const shortTokens = Number($("#workload-short").value);
    const longTokens = Number($("#workload-long").value);
    const errors = [];
    if (!Number.isInteger(count) || count < 1 || count > page.maxPrompts) {
      errors.push(`requests per mode must be 1 to ${page.maxPrompts} (the server's --max-prompts)`);
    }
    if (!(rate >= 0 && rate <= page.maxRate)) errors.push(`rate must be 0 to ${page.maxRate} requests/s`);
    else if (rate > 0 && (count - 1) / rate > page.maxDelay) {
      errors.push(`at that rate the last request would leave after ${((count - 1) / rate).toFixed(0)} s; ` +
        `at most ${page.maxDelay} s`);
    }
    for (const [value, name] of [[shortTokens, "short"], [longTokens, "long"]]) {
      if (!Number.isInteger(value) || value < 1 || value > page.maxTokens) {
        errors.push(`${name} must be 1 to ${page.maxTokens} tokens`);
      }
    }
    return { kind, count, rate, shortTokens, longTokens, ignoreEos: $("#workload-ignore-eos").checked, errors };
  }

  async function sendWorkload(event) {
    event.preventDefault();
    const note = $("#workload-note");
    const form = readWorkloadForm();
    if (form.errors.length) {
      note.textContent = form.errors.join("; ");
      return;
    }
    const nowMs = performance.now();
    if (page.workload && page.workload.pending > 0) {
      note.textContent = "the last workload is still running";
      return;
    }
    if (nowMs - page.lastSendMs < MIN_SEND_INTERVAL_MS) {
      note.textContent = "one workload a second at most";
      return;
    }
    page.lastSendMs = nowMs;
    const specs = buildWorkload(form.kind, form.count, form.rate, form.shortTokens, form.longTokens);
    const startMs = performance.now();
    page.workload = { startT: serverNow(), endT: null, pending: specs.length * page.modes.length, startMs };
    document.body.dataset.workload = "running";
    $("#send").disabled = true;
    note.textContent = `sending ${specs.length} requests to each of ${page.modes.length} mode(s)`;
    const boxes = new Map(); // "<mode>|<page index>" -> its box
    for (const view of page.modes) {
      for (const spec of specs) boxes.set(`${view.mode}|${spec.index}`, addBox(view, spec));
    }
    await streamWorkload(specs, boxes, form.ignoreEos, startMs);
    page.workload.endT = serverNow();
    document.body.dataset.workload = "done";
    $("#send").disabled = false;
    note.textContent = `done: ${specs.length} requests per mode`;
  }

  function addBox(view, spec) {
    const box = document.createElement("li");
    box.className = "request";
    page.nextBoxId += 1;
    Object.assign(box.dataset, {
      mode: view.mode,
      kind: spec.kind,
      maxTokens: spec.maxTokens,
      pageIndex: spec.index,
      requestId: "",
      state: "sent",
    });
    box.id = `box-${view.mode}-${page.nextBoxId}`;
    const head = document.createElement("div");
    head.className = "request-head";
    head.innerHTML = '<span class="request-label"></span><span class="request-state"></span><span class="request-times"></span>';
    head.firstElementChild.textContent = `#${spec.index + 1} ${spec.kind} · ${spec.maxTokens} tok`;
    const text = document.createElement("div");
    text.className = "request-text";
    box.append(head, text);
    view.boxes.prepend(box);
    while (view.boxes.children.length > MAX_BOXES_PER_MODE) view.boxes.lastElementChild.remove();
    renderBox(box);
    return box;
  }

  function renderBox(box) {
    const d = box.dataset;
    $(".request-state", box).textContent = d.state;
    const parts = [];
    if (d.firstTokenAt) parts.push(`TTFT ${formatSeconds((d.firstTokenAt - d.sentAt) / 1000)}`);
    if (d.finishedAt) parts.push(`end ${formatSeconds((d.finishedAt - d.sentAt) / 1000)}`);
    if (d.serverHeldMs) parts.push(`held ${formatSeconds(d.serverHeldMs / 1000)}`);
    $(".request-times", box).textContent = parts.join(" · ");
  }

  // Server-side lifecycle times of a box's request, from the event stream (seconds on the server clock):
  // data-server-queued-t, -admitted-t, -first-token-t, -finished-t, -released-t.
  const SERVER_TIMES = {
    queued: "serverQueuedT",
    admitted: "serverAdmittedT",
    first_token: "serverFirstTokenT",
    finished: "serverFinishedT",
    released: "serverReleasedT",
  };

  function applyServerTimes(box, record) {
    for (const [name, attribute] of Object.entries(SERVER_TIMES)) {
      if (record[name] != null) box.dataset[attribute] = record[name];
    }
    if (record.seat != null) box.dataset.seat = record.seat;
    if (record.released != null) {
      // Held: from the event saying it finished to the one releasing it (the same step unless its batch holds it).
      box.dataset.serverHeldMs = Math.round((record.released - (record.finished ?? record.released)) * 1000);
    }
    if (record.finished != null && record.released == null && !box.dataset.finishedAt) {
      box.dataset.state = "held"; // generated in full, waiting for the rest of its batch
    }
    renderBox(box);
  }

  // One request for the whole workload: the server starts each request in every pane at its delay and streams
  // back every answer's pieces, {pane, index, request_id, text, finish_reason, error}, on this one connection.
  async function streamWorkload(specs, boxes, ignoreEos, startMs) {
    const body = {
      panes: page.modes.map((view) => view.mode),
      requests: specs.map((spec) => ({
        index: spec.index, prompt: spec.prompt, max_tokens: spec.maxTokens, delay_s: spec.delay,
      })),
      ignore_eos: ignoreEos,
    };
    const since = () => (performance.now() - startMs).toFixed(1);
    const finish = (box, state) => {
      if (box.dataset.finishedAt) return;
      box.dataset.finishedAt = since();
      if (!box.dataset.sentAt) box.dataset.sentAt = box.dataset.finishedAt; // it never started
      box.dataset.state = state;
      renderBox(box);
      page.workload.pending -= 1;
    };
    const failRest = (message) => {
      for (const box of boxes.values()) {
        if (box.dataset.finishedAt) continue;
        $(".request-text", box).append(message);
        finish(box, "error");
      }
    };
    try {
      const response = await fetch(WORKLOAD_PATH, {
        method: "POST",
        headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
        body: JSON.stringify(body),
      });
      if (!response.ok || !response.body) {
        failRest(await errorMessage(response));
        if (response.status === 401) askForKey("the API key was refused");
        return;
      }
      await readSse(response, (type, raw) => {
        if (raw === "[DONE]") return;
        const event = JSON.parse(raw);
        const view = page.views.get(event.pane);
        const box = boxes.get(`${event.pane}|${event.index}`);
        if (!view || !box || box.dataset.finishedAt) return;
        if (!box.dataset.sentAt) box.dataset.sentAt = since(); // the server started it (or could not)
        if (event.request_id && !box.dataset.requestId) view.link(box, event.request_id);
        if (event.error) {
          $(".request-text", box).append(` [${event.error.message}]`);
          finish(box, "error");
          return;
        }
        if (event.text) {
          if (!box.dataset.firstTokenAt) {
            box.dataset.firstTokenAt = since();
            box.dataset.state = "streaming";
          }
          $(".request-text", box).append(event.text);
        }
        if (event.finish_reason) {
          box.dataset.finishReason = event.finish_reason;
          finish(box, "done");
        } else {
          renderBox(box);
        }
      });
      failRest(" [the stream ended early]");
    } catch (error) {
      failRest(` [${String(error)}]`);
    }
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      return `HTTP ${response.status}: ${body.error ? body.error.message : JSON.stringify(body)}`;
    } catch {
      return `HTTP ${response.status}`;
    }
  }

  // ---- the API key ----
  function askForKey(reason) {
    const form = $("#key-form");
    form.hidden = false;
    $("label", form).textContent = `${reason}:`;
    setStatus("key", "API key needed");
    $("#api-key").focus();
  }

  function onKeySubmit(event) {
    event.preventDefault();
    page.key = $("#api-key").value.trim();
    sessionStorage.setItem(KEY_STORAGE, page.key);
    $("#key-form").hidden = true;
    start();
  }

  // ---- start: ask the server which modes it serves, build a pane per mode, subscribe ----
  let subscriptions = [];

  async function start() {
    for (const controller of subscriptions) controller.abort();
    subscriptions = [];
    let info;
    try {
      const response = await fetch(MODES_PATH, { headers: headers() });
      if (response.status === 401) {
        askForKey(page.key ? "the API key was refused; enter it again" : "this server needs its API key");
        return;
      }
      if (!response.ok) throw new Error(await errorMessage(response));
      info = await response.json();
    } catch (error) {
      setStatus("down", `cannot reach the server: ${error.message}`);
      setTimeout(start, RECONNECT_MS);
      return;
    }
    page.maxPrompts = info.max_prompts || page.maxPrompts;
    page.maxRate = info.max_rate || DEFAULT_MAX_RATE;
    page.maxTokens = info.max_tokens || DEFAULT_MAX_TOKENS;
    page.maxDelay = info.max_delay_s || DEFAULT_MAX_DELAY_S;
    $("#workload-count").max = page.maxPrompts;
    $("#workload-rate").max = page.maxRate;
    const panes = $("#panes");
    panes.replaceChildren();
    page.modes = [];
    page.views.clear();
    for (const mode of info.data) {
      const view = new ModeView(mode);
      page.modes.push(view);
      page.views.set(view.mode, view);
      panes.append(view.section);
    }
    panes.dataset.count = page.modes.length;
    // Three or more panes side by side: each narrower, its figures go under its lanes (style.css).
    panes.dataset.layout = page.modes.length >= 3 ? "narrow" : "wide";
    subscriptions.push(subscribe(EVENTS_PATH, page.modes.length === 1 ? page.modes[0].mode : null));
    $("#send").disabled = false;
    document.body.dataset.ready = "true";
  }

  // ---- the time window: what the lanes show and what they keep ----
  // The lanes' now: the server clock, or the moment "pause" was ticked.
  function viewNow() {
    const paused = $("#pause").checked;
    if (!paused) page.frozenNow = null;
    else page.frozenNow ??= serverNow();
    return paused ? page.frozenNow : serverNow();
  }

  // The last workload's run on the server clock, padded a little: what "fit the last workload" shows, kept until the
  // next workload starts. While it runs it ends now.
  function workloadSpan(now) {
    const workload = page.workload;
    if (!workload) return null;
    const end = workload.endT ?? now;
    const pad = Math.max(0.2, 0.03 * (end - workload.startT));
    return { from: workload.startT - pad, until: end + pad, running: workload.endT == null };
  }

  // What the lanes keep: the last keepS seconds, and the last workload's whole run (open-ended while it runs).
  // Without a workload running that is bounded by time; a workload's run by its requests (--max-prompts per pane).
  function keptSpans(now) {
    const spans = [[now - page.keepS, Infinity]];
    const run = workloadSpan(now);
    if (run) spans.push([run.from, run.running ? Infinity : run.until]);
    const body = document.body.dataset;
    body.keptSinceT = now - page.keepS; // hooks: bars that ended before this go, unless in the run below
    body.runKeptFromT = run ? run.from : "";
    body.runKeptUntilT = run && !run.running ? run.until : "";
    return spans;
  }

  // Drawing follows the screen's frames; keeping and the figures a timer's, so a tab in the background prunes too.
  function frame() {
    requestAnimationFrame(frame);
    if (document.hidden || !page.modes.length) return;
    const now = viewNow();
    let tStart;
    let tEnd = now;
    let origin = now;
    const choice = $("#window").value;
    const run = choice === "workload" ? workloadSpan(now) : null;
    if (run) {
      tStart = run.from;
      tEnd = run.until;
      origin = page.workload.startT;
    } else {
      tStart = now - (choice === "workload" ? 30 : Number(choice));
    }
    for (const view of page.modes) view.draw(tStart, tEnd, origin);
  }

  function refresh() {
    if (!page.modes.length) return;
    const now = viewNow();
    const spans = keptSpans(now);
    for (const view of page.modes) {
      view.prune(now, spans);
      view.updateFigures(now);
    }
  }

  readColors();
  $("#workload").addEventListener("submit", sendWorkload);
  $("#key-form").addEventListener("submit", onKeySubmit);
  document.body.dataset.keepS = page.keepS;
  start();
  requestAnimationFrame(frame);
  setInterval(refresh, FIGURES_EVERY_MS);
})();
