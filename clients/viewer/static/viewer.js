// The rollout viewer: loads table rows page by page from /api/rollouts,
// filters and sorts them here, draws the reward histogram as SVG, and fetches
// one whole rollout from /api/rollout when a row is opened.
// Every value from the file goes into the page as text, never as HTML.
"use strict";

const PAGE_SIZE = 2000;
const ROWS_SHOWN = 1000; // more rows than this make the table slow; filters narrow it
const STATUSES = ["SCORED", "UNSCORED", "INFRA_ERROR"];
const SVG_NS = "http://www.w3.org/2000/svg";

const state = {
  rows: [],
  sort: { key: "rollout_id", descending: false },
  filter: { text: "", env: "", statuses: new Set(STATUSES), rewardMin: null, rewardMax: null },
  selected: null,
  loading: false,
};

const $ = (selector) => document.querySelector(selector);

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attributes = {}, text = "") {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text) node.textContent = text;
  return node;
}

async function getJson(url) {
  const response = await fetch(url, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
  return body;
}

function formatReward(value) {
  if (value === null || value === undefined) return "–";
  return Number.isInteger(value) ? value.toFixed(1) : value.toFixed(3).replace(/0+$/, "").replace(/\.$/, ".0");
}

function formatNumber(value, digits = 0) {
  if (value === null || value === undefined) return "–";
  return digits ? value.toFixed(digits) : value.toLocaleString("en-US");
}

// ---- loading ---------------------------------------------------------------

async function load() {
  if (state.loading) return;
  state.loading = true;
  $("#reload").disabled = true;
  try {
    const rows = [];
    let offset = 0; // offset 0 makes the server read lines appended since last time
    while (offset !== null) {
      const page = await getJson(`/api/rollouts?offset=${offset}&limit=${PAGE_SIZE}`);
      rows.push(...page.rows);
      offset = page.next_offset;
      state.rows = rows.slice();
      render();
    }
    state.rows = rows;
    showSummary(await getJson("/api/summary"));
    render();
    if (!state.selected && location.hash.startsWith("#key=")) openRollout(decodeURIComponent(location.hash.slice(5)));
  } catch (error) {
    showProblems([`Could not load rollouts: ${error.message}`]);
  } finally {
    state.loading = false;
    $("#reload").disabled = false;
    document.body.dataset.ready = "true";
  }
}

function showSummary(summary) {
  const files = $("#files");
  files.replaceChildren();
  for (const [source, file] of Object.entries(summary.files)) {
    if (source === "failures" && !file.exists) continue;
    files.append(el("span", { class: `file file-${source}`, title: file.path },
      el("b", { text: source }), ` ${file.path.split("/").pop()} · ${file.rows}`));
  }
  showProblems(summary.problems);
  const envs = [...new Set(state.rows.map((row) => row.env))].sort();
  const select = $("#env");
  const chosen = select.value;
  select.replaceChildren(el("option", { value: "", text: "all envs" }), ...envs.map((env) => el("option", { value: env, text: env })));
  select.value = envs.includes(chosen) ? chosen : "";
}

function showProblems(problems) {
  const box = $("#problems");
  box.hidden = problems.length === 0;
  box.replaceChildren(...problems.slice(0, 20).map((problem) => el("div", { text: problem })));
  if (problems.length > 20) box.append(el("div", { text: `… and ${problems.length - 20} more` }));
}

// ---- filtering and sorting ---------------------------------------------------

function matchesText(row, text) {
  if (!text) return true;
  const haystack = [row.rollout_id, row.task, row.env, row.status, row.error, ...row.tools].join("\n").toLowerCase();
  return text.split(/\s+/).every((word) => haystack.includes(word));
}

// All filters but the reward range: the histogram shows this, so that a range
// chosen on it can be widened again.
function filteredExceptReward() {
  const { text, env, statuses } = state.filter;
  const words = text.trim().toLowerCase();
  return state.rows.filter((row) => statuses.has(row.status) && (!env || row.env === env) && matchesText(row, words));
}

function inRewardRange(row) {
  const { rewardMin, rewardMax } = state.filter;
  if (rewardMin === null && rewardMax === null) return true;
  if (row.reward === null) return false;
  return (rewardMin === null || row.reward >= rewardMin) && (rewardMax === null || row.reward <= rewardMax);
}

function compareRows(a, b) {
  const { key, descending } = state.sort;
  const x = a[key], y = b[key];
  // missing values sort last either way
  if (x === null || x === undefined || x === "") return y === null || y === undefined || y === "" ? 0 : 1;
  if (y === null || y === undefined || y === "") return -1;
  const order = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y), undefined, { numeric: true });
  return descending ? -order : order;
}

// ---- rendering ----------------------------------------------------------------

function render() {
  const base = filteredExceptReward();
  const rows = base.filter(inRewardRange).sort(compareRows);
  renderStats(rows);
  renderHistogram(base);
  renderTable(rows);
}

function renderStats(rows) {
  const counts = Object.fromEntries(STATUSES.map((status) => [status, 0]));
  for (const row of rows) counts[row.status] = (counts[row.status] || 0) + 1;
  const rewards = rows.map((row) => row.reward).filter((reward) => reward !== null);
  const mean = rewards.length ? rewards.reduce((sum, reward) => sum + reward, 0) / rewards.length : null;
  const stats = $("#stats");
  stats.replaceChildren(
    el("div", { class: "stat" }, el("span", { class: "stat-value", text: formatNumber(rows.length) }), el("span", { class: "stat-label", text: `of ${formatNumber(state.rows.length)} rollouts` })),
    el("div", { class: "stat" }, el("span", { class: "stat-value", text: mean === null ? "–" : mean.toFixed(3) }), el("span", { class: "stat-label", text: "mean reward" })),
    ...STATUSES.map((status) => el("div", { class: "stat" },
      el("span", { class: `stat-value status-text-${status}`, text: formatNumber(counts[status]) }),
      el("span", { class: "stat-label", text: status.toLowerCase().replace("_", " ") }))),
  );
}

// Bins: one per distinct value when there are few (binary or graded rewards),
// else 20 of equal width between the smallest and largest reward.
function binRewards(rewards) {
  const distinct = [...new Set(rewards)].sort((a, b) => a - b);
  if (distinct.length <= 12) {
    return distinct.map((value) => ({ low: value, high: value, label: formatReward(value), count: rewards.filter((r) => r === value).length }));
  }
  const low = distinct[0], high = distinct[distinct.length - 1], count = 20, width = (high - low) / count;
  const bins = Array.from({ length: count }, (_, i) => ({ low: low + i * width, high: low + (i + 1) * width, count: 0 }));
  for (const reward of rewards) bins[Math.min(count - 1, Math.floor((reward - low) / width))].count += 1;
  for (const bin of bins) bin.label = formatReward(bin.low);
  return bins;
}

function renderHistogram(rows) {
  const chart = $("#histogram");
  const width = 520, height = 150, left = 34, bottom = 22, top = 14;
  chart.setAttribute("viewBox", `0 0 ${width} ${height}`);
  chart.replaceChildren();
  const rewards = rows.map((row) => row.reward).filter((reward) => reward !== null);
  if (!rewards.length) {
    chart.append(svg("text", { x: width / 2, y: height / 2, class: "empty", "text-anchor": "middle" }, "no rewards to show"));
    return;
  }
  const bins = binRewards(rewards);
  const most = Math.max(...bins.map((bin) => bin.count));
  const plotWidth = width - left - 6, plotHeight = height - top - bottom;
  const slot = plotWidth / bins.length, barWidth = Math.max(2, Math.min(slot * 0.8, 90));
  chart.append(svg("line", { x1: left, x2: width - 6, y1: top + plotHeight, y2: top + plotHeight, class: "axis" }));
  chart.append(svg("text", { x: left - 6, y: top + 4, class: "tick", "text-anchor": "end" }, String(most)));
  chart.append(svg("text", { x: left - 6, y: top + plotHeight, class: "tick", "text-anchor": "end" }, "0"));
  const labelEvery = Math.ceil(bins.length / 10);
  bins.forEach((bin, i) => {
    const barHeight = most ? (bin.count / most) * plotHeight : 0;
    const x = left + i * slot + (slot - barWidth) / 2;
    const chosen = inRewardRange({ reward: bin.low }) && inRewardRange({ reward: bin.high });
    const bar = svg("rect", { x, y: top + plotHeight - barHeight, width: barWidth, height: Math.max(barHeight, 1), rx: 2,
      class: `bar${chosen ? "" : " bar-out"}`, "data-count": bin.count, "data-low": bin.low, "data-high": bin.high });
    bar.append(svg("title", {}, `reward ${bin.low === bin.high ? formatReward(bin.low) : `${formatReward(bin.low)} – ${formatReward(bin.high)}`}: ${bin.count} rollouts`));
    bar.addEventListener("click", () => setRewardRange(bin.low, bin.high));
    chart.append(bar);
    if (bin.count) chart.append(svg("text", { x: x + barWidth / 2, y: top + plotHeight - barHeight - 3, class: "count", "text-anchor": "middle" }, String(bin.count)));
    if (i % labelEvery === 0) chart.append(svg("text", { x: x + barWidth / 2, y: height - 6, class: "tick", "text-anchor": "middle" }, bin.label));
  });
}

function setRewardRange(low, high) {
  const same = state.filter.rewardMin === low && state.filter.rewardMax === high;
  state.filter.rewardMin = same ? null : low; // a second click on the same bar clears the range
  state.filter.rewardMax = same ? null : high;
  $("#reward-min").value = same ? "" : String(low);
  $("#reward-max").value = same ? "" : String(high);
  render();
}

function statusBadge(status) {
  return el("span", { class: `badge status-${status}`, text: status || "?" });
}

function renderTable(rows) {
  const body = $("#rollouts tbody");
  const shown = rows.slice(0, ROWS_SHOWN);
  body.replaceChildren(...shown.map((row) => {
    const tr = el("tr", { "data-key": row.key, tabindex: "0" },
      el("td", { class: "id", text: row.rollout_id, title: row.rollout_id }),
      el("td", { class: "task", text: row.task || row.error, title: row.task || row.error }),
      el("td", { class: "num", text: row.sample ?? "–" }),
      el("td", { class: "num reward", text: formatReward(row.reward) }),
      el("td", {}, statusBadge(row.status)),
      el("td", { class: "num", text: formatNumber(row.steps) }),
      el("td", { class: "num", text: formatNumber(row.tokens), title: `${row.prompt_tokens} prompt + ${row.completion_tokens} completion` }),
      el("td", { class: "num", text: formatNumber(row.seconds, 2) }));
    if (row.key === state.selected) tr.classList.add("selected");
    return tr;
  }));
  for (const th of document.querySelectorAll("#rollouts th")) {
    th.classList.toggle("sorted", th.dataset.sort === state.sort.key);
    th.dataset.direction = th.dataset.sort === state.sort.key ? (state.sort.descending ? "desc" : "asc") : "";
  }
  $("#table-note").textContent = rows.length > ROWS_SHOWN
    ? `Showing the first ${ROWS_SHOWN} of ${rows.length} matching rollouts; narrow the filters to see the rest.`
    : rows.length ? "" : state.rows.length ? "No rollout matches these filters." : "No rollouts yet.";
}

// ---- transcript -----------------------------------------------------------------

async function openRollout(key) {
  state.selected = key;
  for (const tr of document.querySelectorAll("#rollouts tbody tr")) tr.classList.toggle("selected", tr.dataset.key === key);
  history.replaceState(null, "", `#key=${encodeURIComponent(key)}`);
  const detail = $("#detail");
  detail.replaceChildren(el("p", { class: "placeholder", text: "Loading…" }));
  try {
    const rollout = await getJson(`/api/rollout?key=${encodeURIComponent(key)}`);
    if (state.selected === key) renderRollout(rollout);
  } catch (error) {
    detail.replaceChildren(el("p", { class: "error-box", text: `Could not load ${key}: ${error.message}` }));
  }
}

function field(label, value) {
  return el("div", { class: "field" }, el("dt", { text: label }), el("dd", { text: value === null || value === undefined || value === "" ? "–" : String(value) }));
}

function renderRollout(rollout) {
  const detail = $("#detail");
  const tokens = rollout.tokens || {}, version = rollout.policy_version || {};
  const ending = rollout.terminated ? "terminated" : rollout.truncated ? "truncated" : "not finished";
  const header = el("div", { class: "detail-header" },
    el("h2", { text: rollout.rollout_id || "(no rollout_id)" }),
    statusBadge(rollout.status),
    el("span", { class: "detail-reward", text: rollout.reward === null || rollout.reward === undefined ? "no reward" : `reward ${formatReward(rollout.reward)}` }));
  const facts = el("dl", { class: "facts" },
    field("env", `${rollout.env ?? ""} · ${rollout.split ?? ""} · #${rollout.index ?? ""}`),
    field("sample", rollout.sample),
    field("steps", `${rollout.steps ?? "–"} (${ending})`),
    field("tokens", `${tokens.prompt ?? 0} prompt + ${tokens.completion ?? 0} completion`),
    field("policy version", version.min === version.max ? version.min : `${version.min} – ${version.max}`),
    field("seconds", rollout.seconds === undefined || rollout.seconds === null ? null : rollout.seconds.toFixed(2)),
    field("finished", rollout.finished_at),
    field("trace id", rollout.trace_id));
  const parts = [header];
  if (rollout.error) parts.push(el("pre", { class: "error-box", text: rollout.error }));
  parts.push(facts);
  const components = Object.entries(rollout.reward_components || {});
  if (components.length || rollout.reward_detail) {
    const box = el("div", { class: "reward-box" }, el("h3", { text: "Reward" }));
    if (components.length) box.append(el("dl", { class: "facts" }, ...components.map(([name, value]) => field(name, formatReward(value)))));
    if (rollout.reward_detail) box.append(el("p", { class: "reward-detail", text: rollout.reward_detail }));
    parts.push(box);
  }
  const task = Object.entries(rollout.task || {});
  if (task.length) {
    parts.push(el("div", { class: "task-box" }, el("h3", { text: "Task" }),
      el("dl", { class: "facts" }, ...task.map(([name, value]) => field(name, typeof value === "string" ? value : JSON.stringify(value))))));
  }
  const messages = rollout.messages || [];
  parts.push(el("h3", { text: `Transcript · ${messages.length} messages` }));
  parts.push(el("div", { class: "transcript" }, ...messages.map(renderMessage)));
  detail.replaceChildren(...parts);
  detail.scrollTop = 0;
}

function prettyArguments(text) {
  try {
    return JSON.stringify(typeof text === "string" ? JSON.parse(text) : text, null, 2);
  } catch {
    return String(text); // not JSON: shown as the model wrote it
  }
}

function renderMessage(message) {
  const role = message.role || "unknown";
  const head = el("div", { class: "message-head" }, el("span", { class: "role", text: role === "tool" ? "tool output" : role }));
  if (message.name) head.append(el("span", { class: "tool-name", text: message.name }));
  if (message.tool_call_id) head.append(el("span", { class: "call-id", text: message.tool_call_id }));
  const card = el("article", { class: `message role-${role}` }, head);
  if (message.content) card.append(el(role === "tool" ? "pre" : "div", { class: role === "tool" ? "tool-output" : "content", text: message.content }));
  for (const call of message.tool_calls || []) {
    card.append(el("div", { class: "tool-call" },
      el("div", { class: "tool-call-head" }, el("span", { class: "call-label", text: "tool call" }), el("span", { class: "tool-name", text: call.name || "?" }), el("span", { class: "call-id", text: call.id || "" })),
      el("pre", { class: "arguments", text: prettyArguments(call.arguments) })));
  }
  for (const part of message.parts || []) {
    if (part.type === "image" && /^image\/[\w.+-]+$/.test(part.mime_type || "")) {
      card.append(el("figure", { class: "image-part" },
        el("img", { src: `data:${part.mime_type};base64,${part.data_base64 || ""}`, alt: `image (${part.mime_type})` })));
    } else if (part.type === "file") {
      card.append(el("div", { class: "file-part", text: `file: ${part.uri}${part.mime_type ? ` (${part.mime_type})` : ""}` }));
    }
  }
  if (!message.content && !(message.tool_calls || []).length && !(message.parts || []).length) {
    card.append(el("div", { class: "content empty", text: "(empty)" }));
  }
  return card;
}

// ---- wiring ------------------------------------------------------------------------

function readNumber(input) {
  return input.value.trim() === "" || Number.isNaN(Number(input.value)) ? null : Number(input.value);
}

function wire() {
  const statuses = $("#statuses");
  for (const status of STATUSES) {
    const box = el("input", { type: "checkbox", value: status, id: `status-${status}` });
    box.checked = true;
    box.addEventListener("change", () => {
      if (box.checked) state.filter.statuses.add(status); else state.filter.statuses.delete(status);
      render();
    });
    statuses.append(el("label", { class: `status-toggle status-${status}`, for: `status-${status}` }, box, status));
  }
  $("#search").addEventListener("input", (event) => { state.filter.text = event.target.value; render(); });
  $("#env").addEventListener("change", (event) => { state.filter.env = event.target.value; render(); });
  for (const [id, bound] of [["#reward-min", "rewardMin"], ["#reward-max", "rewardMax"]]) {
    $(id).addEventListener("input", (event) => { state.filter[bound] = readNumber(event.target); render(); });
  }
  $("#clear").addEventListener("click", () => {
    $("#filters").reset();
    for (const box of document.querySelectorAll("#statuses input")) box.checked = true;
    Object.assign(state.filter, { text: "", env: "", statuses: new Set(STATUSES), rewardMin: null, rewardMax: null });
    render();
  });
  for (const th of document.querySelectorAll("#rollouts th")) {
    th.addEventListener("click", () => {
      const key = th.dataset.sort;
      state.sort = { key, descending: state.sort.key === key ? !state.sort.descending : ["reward", "steps", "tokens", "seconds"].includes(key) };
      render();
    });
  }
  const body = $("#rollouts tbody");
  body.addEventListener("click", (event) => {
    const tr = event.target.closest("tr");
    if (tr) openRollout(tr.dataset.key);
  });
  body.addEventListener("keydown", (event) => {
    const tr = event.target.closest("tr");
    if (tr && event.key === "Enter") openRollout(tr.dataset.key);
  });
  $("#reload").addEventListener("click", load);
}

wire();
load();
