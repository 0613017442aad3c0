// What every view shares: the JSON API and its jobs, the error line, element builders, formatting.
// The views (one module each) import from here and from nothing else but each other's exports.

export const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
export const session = {model: null};  // /api/model's answer, once the page has started

// ------------------------------------------------------------------------------------------ plumbing
export async function api(path, body, method = body === undefined ? "GET" : "POST") {
  const options = body === undefined ? {method} :
    {method, headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
  const response = await fetch(path, options);
  // a crash outside our handlers answers plain text, not JSON: its status is the message then
  const data = await response.json().catch(() => ({error: `${response.status} ${response.statusText}`}));
  if (!response.ok) {
    // our handlers answer {"error": message}; FastAPI's own request validation answers {"detail": [...]}
    const detail = Array.isArray(data.detail) ? data.detail.map((d) => `${d.loc.join(".")}: ${d.msg}`).join("; ") : data.detail;
    throw new Error(data.error || detail || response.statusText);
  }
  return data;
}

export function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// What the server changed in the input (a prompt cut to the model's positions, unknown words, padding):
// one line each, above the view, until the next request.
export function showNotices(notices = []) {
  const box = $("notices");
  box.replaceChildren(...notices.map((text) => el("p", {class: "notice"}, text)));
  box.hidden = !notices.length;
}

// Run a form's work; a failure is a message in the page, never an uncaught error, and it clears the
// results of the request before (`stale`: the ids of what the work draws), which would otherwise sit
// under the message as if they were its answer.
export function handle(work, ...stale) {
  return async (event) => {
    if (event) event.preventDefault();
    showError("");
    showNotices();
    try {
      await work();
    } catch (error) {
      showError(error.message);
      for (const id of stale) clear($(id));
    }
  };
}

export function clear(node) {
  if (node.classList.contains("js-plotly-plot")) Plotly.purge(node);
  node.replaceChildren();
  for (const key of Object.keys(node.dataset)) delete node.dataset[key];
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// The job queue in the header: every job that runs or waits, with its place and progress.
export async function showQueue() {
  const {jobs} = await api("/api/jobs");
  $("queue").replaceChildren(...jobs.map((job) => {
    const item = el("span", {class: `queued ${job.state}`, "data-id": job.id},
      job.state === "running" ? `${job.kind} ${job.progress === null ? "running" : `${Math.round(100 * job.progress)}%`}`
                              : `${job.kind} (waiting, ${job.place} ahead)`);
    const cancel = el("button", {type: "button", class: "cancel-job", title: `cancel ${job.kind}`}, "×");
    cancel.onclick = () => api(`/api/jobs/${job.id}`, undefined, "DELETE").then(showQueue).catch(() => {});
    item.append(cancel);
    return item;
  }));
  $("queue").hidden = !jobs.length;
}

// Start a background job and poll it, showing its progress (a bar, or a moving one when unknown), its
// place in the queue while it waits, and a button that cancels it (DELETE /api/jobs/{id}).
export async function runJob(path, body, barId) {
  const bar = $(barId);
  const {job} = await api(path, body);
  bar.hidden = false;
  let cancel = bar.parentNode.querySelector(`#${barId}-cancel`);
  if (!cancel) {
    cancel = el("button", {type: "button", id: `${barId}-cancel`, class: "cancel"}, "cancel");
    bar.after(cancel);
  }
  cancel.hidden = false;
  cancel.disabled = false;
  cancel.onclick = () => { cancel.disabled = true; api(`/api/jobs/${job}`, undefined, "DELETE").catch(() => {}); };
  try {
    for (;;) {
      const status = await api(`/api/jobs/${job}`);
      bar.dataset.state = status.state;
      bar.classList.toggle("indeterminate", status.progress === null && status.state === "running");
      bar.firstElementChild.style.width = status.progress === null ? "" : `${100 * status.progress}%`;
      const work = status.total ? `, ${status.done} of ${status.total} ${status.unit}${status.phase ? ` (${status.phase})` : ""}` : "";
      const place = status.state === "queued" ? `, ${status.place} job${status.place === 1 ? "" : "s"} ahead` : "";
      bar.lastElementChild.textContent = `${status.kind}: ${status.state}${place}${work}, ${status.elapsed.toFixed(1)} s`;
      await showQueue();
      if (status.state === "done") return status.result;
      if (status.state === "error") throw new Error(status.error);
      if (status.state === "cancelled") throw new Error(`${status.kind} cancelled`);
      await sleep(150);
    }
  } finally {
    bar.hidden = true;
    cancel.hidden = true;
    await showQueue().catch(() => {});
  }
}

export function el(tag, attributes = {}, text = "") {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (text) node.textContent = text;
  return node;
}

export function svgEl(tag, attributes = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  return node;
}

export const uniqueLabels = (tokens) => tokens.map((t, i) => `${i} ${t}`);

// Colour scales: ColorBrewer's sequential Blues (more is darker: more attention, more ink) and diverging
// RdBu, blue negative and red positive, at nine stops as matplotlib and plotly.py ship them. The
// attribution graph's plot (AttributionGraph.plot) uses the same two.
const stops = (colours) => colours.map((c, i) => [i / (colours.length - 1), c]);
export const BLUES = stops(["#f7fbff", "#deebf7", "#c6dbef", "#9dcae1", "#6aaed6", "#4191c6", "#2070b4", "#08509b",
                            "#08306b"]);
export const RED_BLUE = stops(["#053061", "#2a71b2", "#6bacd1", "#c2ddec", "#f7f6f6", "#fbccb4", "#e48066", "#ba2832",
                               "#67001f"]);

// A position axis with every token labelled: each tick is its position and token, cut to `room` characters
// when the ticks are many (the full text is in the hover), in a smaller font the more there are.
export const tokenAxis = (tokens, extra = {}) => labelAxis(uniqueLabels(tokens), extra);

export function labelAxis(labels, extra = {}) {
  const tokens = labels;
  const room = tokens.length > 40 ? 4 : tokens.length > 20 ? 8 : 16;
  const short = labels.map((label) => (label.length > room + 2 ? `${label.slice(0, room + 1)}…` : label));
  return {type: "category", tickmode: "array", tickvals: labels, ticktext: short, automargin: true, showgrid: false,
          tickfont: {size: tokens.length > 40 ? 8 : tokens.length > 20 ? 10 : 12},
          tickangle: tokens.length > 12 ? -90 : -45, ...extra};
}

// A query x key matrix with the keys a query cannot see (after it: causal attention) blank, not drawn.
export const causal = (matrix) => matrix.map((row, q) => row.map((x, k) => (k > q ? null : x)));
export const fmt = (x) => (x === null || x === undefined ? "–" : Number(x).toPrecision(4));

// The four fields of a clean/corrupted pair form whose inputs are named PREFIX-clean, PREFIX-corrupted, ...
export const pair = (prefix) => ({clean: $(`${prefix}-clean`).value, corrupted: $(`${prefix}-corrupted`).value,
                           answer: $(`${prefix}-answer`).value, wrong: $(`${prefix}-wrong`).value});

export function cartesian(lists) {
  return lists.reduce((rows, list) => rows.flatMap((row) => list.map((item) => [...row, item])), [[]]);
}
