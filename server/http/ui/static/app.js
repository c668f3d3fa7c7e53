// hsdp-serve's page: reads /ready, /info and /metrics, chats through /v1/chat/completions.
// Plain script, no framework, nothing fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "hsdp-api-key"; // sessionStorage: this tab only
let needKey = false;
let model = null;
let phase = null;

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = sessionStorage.getItem(KEY);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function api(path, options) {
  const r = await fetch(path, Object.assign({}, options || {}, { headers: headers((options || {}).headers) }));
  if (r.status === 401) {
    needKey = true;
    $("key-box").hidden = false;
    if (sessionStorage.getItem(KEY)) $("key-error").textContent = "that key was refused";
    throw new Error("401");
  }
  return r;
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY, $("key").value);
  $("key-error").textContent = "";
  needKey = false;
  $("key-box").hidden = true;
  refreshInfo();
});

const mb = (b) => (b === undefined || b === null ? "" : (b / 1e6).toFixed(1) + " MB");

// -- loading: /ready, every half second until ready --------------------------------------------
async function pollReady() {
  try {
    const r = await fetch("/ready");
    const body = await r.json();
    setPhase(body.phase);
    if (body.phase === "loading") {
      $("loading").hidden = false;
      const ranks = (body.progress && body.progress.ranks) || [];
      const box = $("load-ranks");
      for (const rank of ranks) {
        let row = document.getElementById("load-rank-" + rank.rank);
        if (!row) {
          row = document.createElement("div");
          row.className = "bar";
          row.id = "load-rank-" + rank.rank;
          row.innerHTML = `rank ${rank.rank} <progress max="1" value="0"></progress> <span></span>`;
          box.appendChild(row);
        }
        row.querySelector("progress").value = rank.fraction;
        row.querySelector("span").textContent =
          `${mb(rank.bytes_loaded)} of ${mb(rank.bytes_total)} (${(100 * rank.fraction).toFixed(0)}%)`;
      }
    } else if (body.phase === "warming_up") {
      for (const p of document.querySelectorAll("#load-ranks progress")) p.value = 1;
    }
  } catch (e) {
    setPhase("unreachable");
  }
  if (phase !== "ready") setTimeout(pollReady, 500);
  else start();
}

function setPhase(p) {
  phase = p;
  $("phase").textContent = p;
  $("phase").className = "phase " + p;
}

async function pollHealth() {
  try {
    const r = await fetch("/health");
    const body = await r.json();
    if (body.status === "failed") {
      setPhase("failed");
      $("loading").hidden = false;
      $("failure").textContent = body.error || "the group failed";
    } else if (phase === "ready" || phase === "draining") {
      setPhase(body.phase);
    }
  } catch (e) {
    setPhase("unreachable");
  }
}

// -- the group: /info every two seconds ---------------------------------------------------------
async function refreshInfo() {
  if (needKey) return;
  let info;
  try {
    info = await (await api("/info")).json();
  } catch (e) {
    return;
  }
  $("group").hidden = false;
  $("model").textContent = `${info.model_id} (${info.model_dtype})`;
  $("image-row").hidden = !info.images;  // an image-text model: its chat takes an image
  $("mesh").textContent = `mesh ${info.mesh_shape.replicate} x ${info.mesh_shape.shard} (replicate x shard), ` +
    `${info.world_size} ranks; max ${info.max_total_tokens} tokens a sequence, ${info.max_concurrent_requests} at once`;
  const rows = (info.ranks || []).map((r) => {
    const m = r.memory || {};
    const kv = r.kv_blocks || {};
    const cells = [r.rank, r.replica, r.step_group, r.pid, r.active, r.sequences_started, r.tokens_computed, r.forwards,
      mb(m.shards), mb(m.shared_weights_share), mb(m.gather_ring_share), mb(m.resident), mb(m.kv_pool),
      `${kv.used} / ${kv.total}`, kv.cached, mb(m.pss)];
    return "<tr>" + cells.map((c) => `<td>${c === undefined || c === null ? "" : c}</td>`).join("") + "</tr>";
  });
  document.querySelector("#ranks tbody").innerHTML = rows.join("");
  const res = info.residency || {};
  $("residency").textContent = `resident units: ${res.units !== undefined ? res.units : "?"} of ${res.of !== undefined ? res.of : "?"}` +
    `, all-gather: ${res.all_gather || "?"}, prefetch depth: ${res.prefetch_depth !== undefined ? res.prefetch_depth : "?"}` +
    (info.kv_cache ? `, KV block ${info.kv_cache.block_size} tokens, prefix caching ${info.kv_cache.prefix_caching ? "on" : "off"}` : "");
  const served = (info.weights || {}).served;  // POST /admin/weights: the version served, one in progress
  if (served) {
    const next = served.in_progress;
    $("weights").textContent = `weights ${served.version} (${served.source})` +
      (next ? `; updating to ${next.version} from ${next.source}: ${next.phase}` : "") +
      ((served.replicas || []).length > 1
        ? "; replicas: " + served.replicas.map((r) => `${r.replica} ${r.version}${r.updating ? " (updating)" : ""}`).join(", ")
        : "");
  }
  if (!model) {
    model = info.served_model_names[0];
    $("chat").hidden = false;
  }
}

// -- live figures: /metrics, diffed between scrapes ----------------------------------------------
const scrapes = []; // {t, values: Map(name+labels -> value)}
const WINDOW_S = 300;

function parseMetrics(text) {
  const values = new Map();
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (m) values.set(m[1] + (m[2] || ""), parseFloat(m[3]));
  }
  return values;
}

function histogramQuantile(name, before, after, q) {
  // Prometheus histograms are cumulative: the window's counts are the bucket differences
  const buckets = [];
  for (const [key, v] of after.values) {
    if (!key.startsWith(name + "_bucket{")) continue;
    const le = key.match(/le="([^"]+)"/)[1];
    buckets.push([le === "+Inf" ? Infinity : parseFloat(le), v - (before.values.get(key) || 0)]);
  }
  buckets.sort((a, b) => a[0] - b[0]);
  const total = buckets.length ? buckets[buckets.length - 1][1] : 0;
  if (!total) return null;
  const rank = q * total;
  for (const [le, count] of buckets) if (count >= rank) return le; // at bucket resolution
  return null;
}

const series = { tps: [], running: [], waiting: [], ttft50: [], ttft95: [], itl50: [], itl95: [] };

async function refreshMetrics() {
  let text;
  try {
    text = await (await api("/metrics")).text();
  } catch (e) {
    return;
  }
  const now = { t: performance.now() / 1000, values: parseMetrics(text) };
  scrapes.push(now);
  while (scrapes.length > 2 && now.t - scrapes[0].t > WINDOW_S) scrapes.shift();
  $("live").hidden = false;
  const prev = scrapes.length > 1 ? scrapes[scrapes.length - 2] : null;
  const first = scrapes[0];
  const push = (k, v) => { series[k].push(v); if (series[k].length > 150) series[k].shift(); };
  if (prev) {
    const tokens = (now.values.get("hsdp_generated_tokens_total") || 0) - (prev.values.get("hsdp_generated_tokens_total") || 0);
    push("tps", tokens / (now.t - prev.t));
  }
  push("running", now.values.get("hsdp_running_sequences") || 0);
  push("waiting", now.values.get("hsdp_waiting_sequences") || 0);
  const q = (name, p) => (first !== now ? histogramQuantile(name, first, now, p) : null);
  push("ttft50", q("hsdp_time_to_first_token_seconds", 0.5));
  push("ttft95", q("hsdp_time_to_first_token_seconds", 0.95));
  push("itl50", q("hsdp_inter_token_latency_seconds", 0.5));
  push("itl95", q("hsdp_inter_token_latency_seconds", 0.95));
  const last = (k) => series[k][series[k].length - 1];
  const fmt = (v) => (v === null || v === undefined ? "-" : v === Infinity ? "> max" : (+v).toFixed(3));
  $("tps").textContent = series.tps.length ? last("tps").toFixed(1) : "";
  $("load").textContent = `${last("running")} / ${last("waiting")}`;
  $("ttft").textContent = `${fmt(last("ttft50"))} / ${fmt(last("ttft95"))}`;
  $("itl").textContent = `${fmt(last("itl50"))} / ${fmt(last("itl95"))}`;
  draw("c-tps", [series.tps]);
  draw("c-load", [series.running, series.waiting]);
  draw("c-ttft", [series.ttft50, series.ttft95]);
  draw("c-itl", [series.itl50, series.itl95]);
}

function draw(id, lines) {
  const canvas = $(id);
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const finite = (v) => v !== null && v !== undefined && isFinite(v);
  const all = lines.flat().filter(finite);
  const top = Math.max(1e-9, ...all);
  const colors = ["#2a6fdb", "#e07b00"];
  lines.forEach((line, i) => {
    ctx.strokeStyle = colors[i % colors.length];
    ctx.beginPath();
    let started = false;
    line.forEach((v, x) => {
      if (!finite(v)) return;
      const px = (x / Math.max(1, 149)) * canvas.width;
      const py = canvas.height - 2 - (v / top) * (canvas.height - 4);
      if (started) ctx.lineTo(px, py); else { ctx.moveTo(px, py); started = true; }
      ctx.fillStyle = ctx.strokeStyle;
      ctx.fillRect(px - 1, py - 1, 2, 2); // single points show too
    });
    ctx.stroke();
  });
}

// -- chat ---------------------------------------------------------------------------------------
const history = [];

let image = null;  // the data: URL of the image the next question shows, if any

function addMessage(role, text, picture) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  if (picture) {
    const img = document.createElement("img");
    img.src = picture;
    div.appendChild(img);
  }
  div.appendChild(document.createTextNode(text));
  $("messages").appendChild(div);
  return div;
}

function setImage(url) {
  image = url;
  $("image-preview").hidden = $("image-clear").hidden = !url;
  $("image-preview").src = url || "";
  if (!url) $("image").value = "";
}

function readImage(file) {
  if (!file || !file.type.startsWith("image/")) return;
  const reader = new FileReader();
  reader.onload = () => setImage(reader.result);
  reader.readAsDataURL(file);
}

$("image").addEventListener("change", () => readImage($("image").files[0]));
$("image-clear").addEventListener("click", () => setImage(null));
$("prompt").addEventListener("paste", (e) => {
  if ($("image-row").hidden) return;
  const item = [...(e.clipboardData ? e.clipboardData.items : [])].find((i) => i.type.startsWith("image/"));
  if (item) { e.preventDefault(); readImage(item.getAsFile()); }
});

$("clear").addEventListener("click", () => { history.length = 0; $("messages").innerHTML = ""; });

$("chat-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || !model) return;
  $("prompt").value = "";
  const picture = image;
  setImage(null);
  history.push({ role: "user", content: picture
    ? [{ type: "image_url", image_url: { url: picture } }, { type: "text", text: prompt }] : prompt });
  addMessage("user", prompt, picture);
  const answer = addMessage("assistant", "");
  const stats = document.createElement("div");
  stats.className = "stats";
  answer.after(stats);
  const body = { model, messages: history, stream: true, temperature: parseFloat($("temperature").value),
    max_tokens: parseInt($("max-tokens").value, 10) };
  const schema = $("schema").value.trim();
  if (schema) {
    try {
      body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(schema) } };
    } catch (err) {
      stats.textContent = "the JSON schema does not parse: " + err.message;
      stats.className = "stats error";
      return;
    }
  }
  $("send").disabled = true;
  const t0 = performance.now();
  let first = null, tokens = 0, text = "";
  try {
    const r = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" } });
    if (!r.ok) {
      const err = await r.json();
      throw new Error((err.error && err.error.message) || r.statusText);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!frame.startsWith("data: ")) continue;
        const data = frame.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "generation failed");
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          if (first === null) first = performance.now();
          tokens += 1;
          text += delta.content;
          answer.textContent = text;
        }
      }
    }
    const total = (performance.now() - t0) / 1000;
    const ttft = first === null ? null : (first - t0) / 1000;
    const rate = first !== null && tokens > 1 ? (tokens - 1) / ((performance.now() - first) / 1000) : null;
    stats.textContent = `time to first token ${ttft === null ? "-" : ttft.toFixed(2) + " s"}, ` +
      `${rate === null ? "-" : rate.toFixed(1)} tokens/s, ${tokens} chunks in ${total.toFixed(2)} s`;
    history.push({ role: "assistant", content: text });
  } catch (err) {
    stats.textContent = "error: " + err.message;
    stats.className = "stats error";
    history.pop();
  } finally {
    $("send").disabled = false;
  }
});

// -- start ----------------------------------------------------------------------------------------
let started = false;
function start() {
  if (started) return;
  started = true;
  $("loading").hidden = true;
  refreshInfo();
  refreshMetrics();
  setInterval(refreshInfo, 2000);
  setInterval(refreshMetrics, 2000);
  setInterval(pollHealth, 2000);
}

pollReady();
