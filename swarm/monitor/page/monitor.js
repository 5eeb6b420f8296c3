// swarm-monitor's page: reads the monitor's API every few seconds and draws it. Everything a peer says of itself
// (names, devices, versions) is shown as text (textContent), never as markup; what goes into plotly (which reads
// a few tags in its labels) is escaped first.
"use strict";

const REFRESH_MS = 4000;
const PLOT_CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
const LAYOUT = {
  margin: { l: 56, r: 16, t: 36, b: 44 }, font: { size: 12 }, hovermode: "closest",
  legend: { orientation: "h", y: -0.25 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff",
};
// the window of the plots over time: ?window=day in the page's address chooses it (a link to share)
const WINDOWS = ["hour", "day", "week", "all"];
let windowName = new URLSearchParams(location.search).get("window");
if (!WINDOWS.includes(windowName)) windowName = "hour";

function escapeForPlotly(text) {
  return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

function peerLabel(peer) {
  return peer.public_name ? `${peer.public_name} (${peer.short_id})` : peer.short_id;
}

function count(n) {
  if (n === null || n === undefined) return "-";
  for (const [unit, size] of [["G", 1e9], ["M", 1e6], ["k", 1e3]]) if (n >= size) return (n / size).toFixed(1) + unit;
  return String(n);
}

function duration(seconds) {
  seconds = Math.floor(seconds);
  if (seconds < 120) return `${seconds}s`;
  if (seconds < 7200) return `${Math.floor(seconds / 60)}m`;
  return `${Math.floor(seconds / 3600)}h${String(Math.floor((seconds % 3600) / 60)).padStart(2, "0")}m`;
}

// a peer's stages: "stage 3", or "stages 2-5" for a peer serving the span [2, 6); "-" for a peer the document
// gives no span (a document from before spans)
function spanText(span) {
  if (!Array.isArray(span) || span.length !== 2) return "-";
  const [start, end] = span;
  return end - start === 1 ? `stage ${start}` : `stages ${start}-${end - 1}`;
}

// whether a peer holds a stage: every stage of its span (only its record's stage without one)
function holds(peer, stage) {
  return Array.isArray(peer.span) ? peer.span[0] <= stage && stage < peer.span[1] : peer.stage === stage;
}

// bytes as swarm/capacity/budget.py's format_memory writes them: "7.51 GiB", "600 MiB"
function formatMemory(size) {
  return size >= 2 ** 30 ? `${(size / 2 ** 30).toFixed(2)} GiB` : `${(size / 2 ** 20).toFixed(0)} MiB`;
}

// "1.50 GiB of 6.00 GiB": what a peer holds of what it may use, as peer-status shows it; "-" from a peer that
// does not say (a peer of an older swarm, or one that has not measured yet)
function memoryText(peer) {
  if (!peer.memory_available) return "-";
  return `${formatMemory(peer.memory_used || 0)} of ${formatMemory(peer.memory_available)}`;
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok && response.status !== 503 && response.status !== 504) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

// ------------------------------------------------------------------------------------------------ health cards

function renderHealth(state) {
  const { swarm, health, training, monitor } = state;
  setText("swarm-name", swarm.name);
  const model = swarm.model;
  setText("swarm-facts", `id ${swarm.swarm_id} · ${(model.parameters / 1e6).toFixed(1)}M parameters, ` +
    `${model.depth} layers, width ${model.width} · ${swarm.stages} stages · averaging ${swarm.averaging}`);
  const card = document.getElementById("status-card");
  card.className = `card ${monitor.status}`;
  setText("status", monitor.status);
  let detail = "every stage is served";
  if (monitor.status === "unreachable") {
    detail = `no peer of the swarm answers${monitor.error ? ` (${monitor.error})` : ""}; ` +
      `last found ${duration(Date.now() / 1000 - monitor.last_read)} ago`;
  } else if (!health.healthy) {
    detail = `unserved stage${health.unserved_stages.length > 1 ? "s" : ""} ${health.unserved_stages.join(", ")}`;
  }
  setText("status-detail", detail);
  setText("bottleneck", `stage ${health.bottleneck_stage}`);
  setText("bottleneck-detail", `${health.bottleneck_throughput.toFixed(1)} samples/s served`);
  setText("efficiency", health.balance_efficiency === null ? "-" : `${Math.round(health.balance_efficiency * 100)}%`);
  setText("peers-online", String(swarm.peers_online));
  setText("trainers", `${training.trainers} trainers` +
    (swarm.peers_unreachable ? `, ${swarm.peers_unreachable} peers dial out (not reachable)` : ""));
  setText("speed", `${training.samples_per_second.toFixed(1)}/s`);
  setText("speed-detail", `samples (${count(Math.round(training.tokens_per_second))} tokens/s), ` +
    `${training.failed_microbatches} failed microbatches`);
  setText("loss", training.loss === null ? "-" : training.loss.toFixed(3));
  setText("tokens", `${count(training.tokens_trained)} tokens trained`);
  document.title = `Swarm ${swarm.name}: ${monitor.status}`;
}

// the swarm's reading of its data (swarm/watch/data_progress.py): how much of its epoch is read, tokens read; a
// document without it (the read of the trainers' records failed) or with no reader says so
function renderData(state) {
  const data = state.data;
  if (!data || !data.readers) {
    setText("data-read", "-");
    setText("data-detail", data ? "no trainer says what it reads yet" : "the trainers' reading could not be read");
    return;
  }
  setText("data-read", `${(data.epoch_read * 100).toFixed(1)}%`);
  setText("data-detail", `of epoch ${data.epoch} (${data.chunks_finished} of ${data.chunks} chunks) · ` +
    `${count(data.tokens_read)} tokens read by ${data.readers} trainer${data.readers === 1 ? "" : "s"}, ` +
    `${data.duplicates} chunks read twice`);
}

// ------------------------------------------------------------------------------------------------ stages

function renderStages(state) {
  const live = state.peers.filter((p) => p.status === "online");
  const stages = state.stages.map((s) => `stage ${s.stage}`);
  // one bar per stage, made of one segment per online peer that holds it (its throughput; a span peer's in each)
  const traces = live.map((peer) => {
    const held = state.stages.filter((s) => holds(peer, s.stage)).map((s) => `stage ${s.stage}`);
    return {
      type: "bar", orientation: "h", name: escapeForPlotly(peerLabel(peer)), y: held, x: held.map(() => peer.throughput),
      hovertemplate: `%{x:.1f} samples/s<extra>%{fullData.name}</extra>`,
    };
  });
  if (!traces.length) traces.push({ type: "bar", orientation: "h", y: stages, x: stages.map(() => 0), name: "no peers" });
  Plotly.react("stage-plot", traces, {
    ...LAYOUT, barmode: "stack", showlegend: false, title: { text: "served throughput (samples/s)" },
    yaxis: { categoryorder: "array", categoryarray: [...stages].reverse(), type: "category" },
    margin: { ...LAYOUT.margin, l: 70 },
  }, PLOT_CONFIG);

  const list = document.getElementById("stage-list");
  list.replaceChildren();
  for (const stage of state.stages) {
    const li = document.createElement("li");
    li.className = `stage-row${stage.online_peers ? "" : " unserved"}`;
    li.dataset.stage = stage.stage;
    const head = document.createElement("strong");
    head.textContent = `stage ${stage.stage}`;
    li.appendChild(head);
    const facts = document.createElement("span");
    facts.className = "muted";
    facts.textContent = ` layers ${stage.layers[0]}..${stage.layers[1] - 1} · ${stage.throughput.toFixed(1)} samples/s ` +
      `(delivered ${stage.delivered_throughput.toFixed(1)}) · ${stage.online_peers} online` +
      (stage.joining_peers ? ` + ${stage.joining_peers} joining` : "") + ` · ${stage.averaging_rounds} rounds: `;
    li.appendChild(facts);
    for (const peer of state.peers.filter((p) => holds(p, stage.stage))) {
      const chip = document.createElement("span");
      chip.className = `chip ${peer.status}`;
      chip.textContent = `${peerLabel(peer)} ${peer.throughput.toFixed(1)}/s`;
      chip.title = peer.status;
      li.appendChild(chip);
    }
    if (!stage.online_peers) li.appendChild(document.createTextNode(" not served"));
    list.appendChild(li);
  }
}

// one box per stage: the peers online that hold it and the samples/s they take together (peer-status' counts: a
// span peer in every stage of its span); a stage held by THIN_PEERS or fewer stands out, one held by none more
const THIN_PEERS = 1;

function renderCoverage(state) {
  const list = document.getElementById("coverage");
  list.replaceChildren();
  for (const stage of state.stages) {
    const box = document.createElement("li");
    const thin = stage.online_peers <= THIN_PEERS;
    box.className = `coverage-stage${thin ? " thin" : ""}${stage.online_peers ? "" : " unserved"}`;
    box.dataset.stage = stage.stage;
    box.title = `layers ${stage.layers[0]}..${stage.layers[1] - 1}` +
      (stage.joining_peers ? `, ${stage.joining_peers} joining` : "") + (thin ? ": held by few peers" : "");
    for (const [className, text] of [
      ["coverage-name", `stage ${stage.stage}`],
      ["coverage-peers", `${stage.online_peers} peer${stage.online_peers === 1 ? "" : "s"}`],
      ["coverage-throughput", `${stage.throughput.toFixed(1)} samples/s`],
    ]) {
      const line = document.createElement("span");
      line.className = className;
      line.textContent = text;
      box.appendChild(line);
    }
    list.appendChild(box);
  }
}

// ------------------------------------------------------------------------------------------------ tables

function renderPeers(state) {
  const body = document.querySelector("#peers-table tbody");
  body.replaceChildren();
  for (const p of state.peers) {
    const row = document.createElement("tr");
    row.className = "peer-row";
    row.dataset.peerId = p.peer_id;
    cell(row, p.short_id).title = p.peer_id;
    cell(row, p.public_name || "-");
    cell(row, spanText(p.span), "span");
    cell(row, p.status, `status-${p.status}`);
    cell(row, `${p.throughput.toFixed(1)}/s`, "n");
    cell(row, `${p.delivered_throughput.toFixed(1)}/s`, "n");
    cell(row, count(p.samples_served), "n");
    cell(row, count(p.attested_samples), "n");
    cell(row, String(p.outstanding), "n");
    cell(row, memoryText(p), "memory");
    cell(row, duration(p.uptime), "n");
    cell(row, `${duration(p.last_seen)} ago`, "n");
    cell(row, p.device);
    cell(row, p.version);
    cell(row, p.reachable ? "yes" : "no (dials out)");
    body.appendChild(row);
  }
}

function renderLeaderboard(board) {
  const body = document.querySelector("#leaderboard-table tbody");
  body.replaceChildren();
  for (const v of board.volunteers) {
    const row = document.createElement("tr");
    row.className = "volunteer-row";
    row.dataset.peerId = v.peer_id;
    cell(row, String(v.rank), "n");
    cell(row, v.public_name || "(no name)");
    cell(row, v.short_id).title = v.peer_id;
    cell(row, count(v.attested_samples), "n");
    cell(row, count(v.claimed_samples), "n").title = `of which ${v.own_trainer_samples} for its own trainer`;
    cell(row, duration(v.hours_online * 3600), "n").title = `${v.hours_online.toFixed(2)} hours`;
    cell(row, String(v.averaging_rounds), "n");
    cell(row, v.disagreement || "ok", v.disagreement ? "flag" : "");
    body.appendChild(row);
  }
}

// ------------------------------------------------------------------------------------------------ plots over time

function renderHistory(history) {
  const times = history.time.map((t) => new Date(t * 1000));
  const line = { type: "scatter", mode: "lines+markers", marker: { size: 4 }, connectgaps: false };
  const xTime = { type: "date", title: { text: "" } };
  Plotly.react("loss-plot", [{ ...line, name: "loss", x: history.tokens_trained, y: history.loss }], {
    ...LAYOUT, title: { text: "training loss" }, xaxis: { title: { text: "tokens trained" } }, yaxis: { title: { text: "loss" } },
  }, PLOT_CONFIG);
  Plotly.react("speed-plot", [{ ...line, name: "samples/s", x: times, y: history.samples_per_second }], {
    ...LAYOUT, title: { text: "swarm samples per second" }, xaxis: xTime, yaxis: { title: { text: "samples/s" }, rangemode: "tozero" },
  }, PLOT_CONFIG);
  const perStage = Object.entries(history.stages).map(([stage, columns]) => ({
    ...line, name: `stage ${stage}`, x: times, y: columns.online_peers, line: { shape: "hv" },
  }));
  Plotly.react("peers-plot", perStage, {
    ...LAYOUT, title: { text: "peers online per stage" }, xaxis: xTime, yaxis: { title: { text: "peers" }, rangemode: "tozero", dtick: 1 },
  }, PLOT_CONFIG);
  Plotly.react("efficiency-plot", [{ ...line, name: "efficiency", x: times, y: history.balance_efficiency }], {
    ...LAYOUT, title: { text: "balance efficiency" }, xaxis: xTime, yaxis: { range: [0, 1.05], tickformat: ".0%" },
  }, PLOT_CONFIG);
}

// ------------------------------------------------------------------------------------------------ refresh loop

async function refresh() {
  try {
    const [state, history, board] = await Promise.all([
      getJSON("/api/v1/state"), getJSON(`/api/v1/history?window=${windowName}`), getJSON("/api/v1/leaderboard"),
    ]);
    renderHealth(state);
    renderData(state);
    renderCoverage(state);
    renderStages(state);
    renderPeers(state);
    renderLeaderboard(board);
    renderHistory(history);
    setText("updated", `Updated ${new Date().toLocaleTimeString()}.`);
    document.body.dataset.loaded = "true";
  } catch (error) {
    const card = document.getElementById("status-card");
    card.className = "card unreachable";
    setText("status", "monitor unreachable");
    setText("status-detail", `the page cannot reach the monitor: ${error.message}`);
  }
}

for (const button of document.querySelectorAll("#windows button")) {
  button.classList.toggle("selected", button.dataset.window === windowName);
  button.addEventListener("click", () => {
    windowName = button.dataset.window;
    window.history.replaceState(null, "", `?window=${windowName}`);
    for (const other of document.querySelectorAll("#windows button")) other.classList.toggle("selected", other === button);
    refresh();
  });
}
refresh();
setInterval(refresh, REFRESH_MS);
