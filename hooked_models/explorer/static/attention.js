// The attention view: every head's pattern (alpha-er: its scores before and after the soft cap too), the
// key/value groups, the tokens a hovered position attends to and is attended by, each position's expert.
import {$, BLUES, RED_BLUE, api, causal, el, showNotices, tokenAxis, uniqueLabels} from "./common.js";

let ATTENTION = null;
export let HEAD = null;

export async function runAttention() {
  ATTENTION = await api("/api/attention", {prompt: $("attention-text").value});
  showNotices(ATTENTION.notices);
  const kinds = $("attention-kind");
  kinds.replaceChildren(el("option", {value: "patterns"}, "pattern"));
  if (ATTENTION.raw_scores) {
    kinds.append(el("option", {value: "scores"}, "scores after the soft cap"),
                 el("option", {value: "raw_scores"}, "scores before the soft cap"));
  }
  const group = ATTENTION.num_heads / ATTENTION.num_kv_heads;
  $("attention-note").textContent = (group > 1 ?
    `Grouped-query attention: ${group} query heads share each key/value head (dashed boxes).` :
    "Every head has its own keys and values.") + (ATTENTION.soft_cap ?
    ` Scores are soft-capped, ${ATTENTION.soft_cap}·tanh(s/${ATTENTION.soft_cap}), before the softmax; ` +
    "each position's MLP expert is fixed by its position (below)." : "");
  const heads = $("attention-heads");
  heads.replaceChildren();
  for (let layer = 0; layer < ATTENTION.num_layers; layer++) {
    const row = el("div", {class: "heads"});
    row.append(el("span", {}, `layer ${layer}`));
    for (let kv = 0; kv < ATTENTION.num_kv_heads; kv++) {
      const box = el("div", {class: "kv-group"});
      box.append(el("span", {}, `kv head ${kv}`));
      ATTENTION.kv_head.forEach((owner, head) => {
        if (owner !== kv) return;
        const button = el("button", {class: "head", id: `head-${layer}-${head}`, type: "button"}, `L${layer}H${head}`);
        button.onclick = () => drawHead(layer, head);
        box.append(button);
      });
      row.append(box);
    }
    heads.append(row);
  }
  const experts = $("attention-experts");
  experts.replaceChildren();
  if (ATTENTION.experts) {
    experts.append(el("span", {}, "expert (layer 0):"));
    const palette = ["#fde68a", "#bfdbfe", "#bbf7d0", "#fecaca", "#ddd6fe", "#fbcfe8"];
    ATTENTION.tokens.forEach((token, i) => {
      const expert = ATTENTION.experts[0][i];
      experts.append(el("span", {class: "token", style: `background:${palette[expert % palette.length]}`,
                                 title: `expert ${expert}`}, `${token}·${expert}`));
    });
  }
  drawHead(0, 0);
}

export function drawHead(layer, head) {
  HEAD = [layer, head];
  for (const button of document.querySelectorAll(".head")) button.classList.remove("active");
  $(`head-${layer}-${head}`).classList.add("active");
  const kind = $("attention-kind").value;
  // every score view leaves the masked (future) keys blank: they take no part in the softmax
  const matrix = causal(ATTENTION[kind][layer][head]);
  const labels = uniqueLabels(ATTENTION.tokens);
  const pattern = kind === "patterns";
  const seen = matrix.flat().filter((x) => x !== null).map(Math.abs);
  const span = Math.max(...seen, 1e-12);
  Plotly.react("attention-plot", [{
    type: "heatmap", z: matrix, x: labels, y: labels, colorscale: pattern ? BLUES : RED_BLUE, hoverongaps: false,
    zmin: pattern ? 0 : -span, zmax: pattern ? 1 : span, colorbar: {title: {text: pattern ? "attention" : "score"}},
    hovertemplate: "query %{y}<br>key %{x}<br>%{z:.4f}<extra></extra>",
  }], {title: {text: `layer ${layer} head ${head} (kv head ${ATTENTION.kv_head[head]}): ${$("attention-kind").selectedOptions[0].text}`},
      xaxis: tokenAxis(ATTENTION.tokens, {title: {text: "key"}}),
      yaxis: tokenAxis(ATTENTION.tokens, {autorange: "reversed", tickangle: 0, title: {text: "query"}}),
      margin: {t: 40}, plot_bgcolor: "#fff"}, {displayModeBar: false});
  for (const strip of ["attention-from", "attention-to"]) {
    const box = $(strip);
    box.replaceChildren();
    ATTENTION.tokens.forEach((token, i) => {
      const span = el("span", {class: "token", "data-index": i}, token);
      span.onmouseenter = () => highlight(i);
      box.append(span);
    });
  }
}

// Hovering token i: "attends to" colours each key by pattern[i][key]; "attended by" each query by pattern[query][i].
function highlight(i) {
  const pattern = ATTENTION.patterns[HEAD[0]][HEAD[1]];
  $("attention-from").querySelectorAll(".token").forEach((span, k) => {
    span.style.background = `rgba(37,99,235,${pattern[i][k]})`;
    span.title = `${pattern[i][k].toFixed(4)}`;
  });
  $("attention-to").querySelectorAll(".token").forEach((span, q) => {
    span.style.background = `rgba(220,38,38,${pattern[q][i]})`;
    span.title = `${pattern[q][i].toFixed(4)}`;
  });
}
