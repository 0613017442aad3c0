// What every view shares: the JSON API and its jobs, the error line, element builders, formatting.
// The views (one module each) import from here and from nothing else but each other's exports.

export const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
export const session = {model: null};  // /api/model's answer, once the page has started

// ------------------------------------------------------------------------------------------ plumbing
export async function api(path, body) {
  const options = body === undefined ? {} :
    {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
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

// Run a form's work; a failure is a message in the page, never an uncaught error.
export function handle(work) {
  return async (event) => {
    if (event) event.preventDefault();
    showError("");
    try { await work(); } catch (error) { showError(error.message); }
  };
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// Start a background job and poll it, showing its progress (a bar, or a moving one when unknown).
export async function runJob(path, body, barId) {
  const bar = $(barId);
  const {job} = await api(path, body);
  bar.hidden = false;
  try {
    for (;;) {
      const status = await api(`/api/jobs/${job}`);
      bar.classList.toggle("indeterminate", status.progress === null && status.state !== "done");
      bar.firstElementChild.style.width = status.progress === null ? "" : `${100 * status.progress}%`;
      bar.lastElementChild.textContent = `${status.kind}: ${status.state}, ${status.elapsed.toFixed(1)} s`;
      if (status.state === "done") return status.result;
      if (status.state === "error") throw new Error(status.error);
      await sleep(150);
    }
  } finally {
    bar.hidden = true;
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
export const fmt = (x) => (x === null || x === undefined ? "–" : Number(x).toPrecision(4));

// The four fields of a clean/corrupted pair form whose inputs are named PREFIX-clean, PREFIX-corrupted, ...
export const pair = (prefix) => ({clean: $(`${prefix}-clean`).value, corrupted: $(`${prefix}-corrupted`).value,
                           answer: $(`${prefix}-answer`).value, wrong: $(`${prefix}-wrong`).value});

export function cartesian(lists) {
  return lists.reduce((rows, list) => rows.flatMap((row) => list.map((item) => [...row, item])), [[]]);
}
