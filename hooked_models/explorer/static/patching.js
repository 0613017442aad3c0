// The patching view: activation_patch's sweep as a heatmap, each cell's exact value on hover.
import {$, RED_BLUE, cartesian, fmt, labelAxis, pair, runJob, showNotices} from "./common.js";

export async function runPatch() {
  const over = $("patch-over").value.trim();
  const result = await runJob("/api/patch", {...pair("patch"), value: $("patch-value").value,
                                             over: over ? over.split(/\s+/) : null}, "patch-progress");
  showNotices(result.notices);
  // Rows: every axis but the last (their labels joined); columns: the last axis, as PatchingResult.plot.
  const axes = result.axes;
  const last = axes.length ? result.labels[axes[axes.length - 1]] : [result.value];
  const rows = cartesian(axes.slice(0, -1).map((axis) => result.labels[axis])).map((row) => row.join(" ") || result.value);
  const flat = (x) => (Array.isArray(x) ? x.flat(Infinity) : [x]);
  const reshape = (values) => rows.map((_, r) => values.slice(r * last.length, (r + 1) * last.length));
  const raw = reshape(flat(result.values));
  const shown = result.normalized ? reshape(flat(result.normalized)) : raw;
  $("patch-summary").textContent = `${result.value} (${result.direction}) over ${axes.join(" × ") || "nothing"}: ` +
    `clean ${fmt(result.clean_metric)}, corrupted ${fmt(result.corrupted_metric)}` +
    (result.normalized ? "; colour: fraction restored (0 corrupted, 1 clean)" : "; colour: metric");
  const plot = $("patch-plot");
  // diverging about 0 (no change from the corrupted run), symmetric so that equal effects get equal ink
  const span = Math.max(...shown.flat().map(Math.abs), 1e-12);
  await Plotly.react(plot, [{
    type: "heatmap", z: shown, customdata: raw, x: last, y: rows, colorscale: RED_BLUE, zmin: -span, zmax: span,
    colorbar: {title: {text: result.normalized ? "restored" : "metric"}},
    hovertemplate: "%{y} %{x}<br>metric %{customdata:.5f}<br>shown %{z:.4f}<extra></extra>",
  }], {title: {text: `activation patching: ${result.value}`}, xaxis: labelAxis(last),
      yaxis: labelAxis(rows, {autorange: "reversed", tickangle: 0}), margin: {t: 40}}, {displayModeBar: false});
  plot.removeAllListeners?.("plotly_hover");
  plot.on("plotly_hover", (event) => {
    const point = event.points[0];
    const [r, c] = point.pointIndex;
    const hover = $("patch-hover");
    hover.dataset.value = String(raw[r][c]);
    hover.dataset.row = r;
    hover.dataset.column = c;
    hover.textContent = `${rows[r]} ${last[c]}: activation_patch gives ${raw[r][c]}`;
  });
}
