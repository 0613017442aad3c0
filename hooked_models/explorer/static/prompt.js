// The prompt view: each position's top predictions and the logit lens of one answer by layer and position.
import {$, api, el, uniqueLabels} from "./common.js";

export async function runPrompt() {
  const answer = $("prompt-answer").value;
  const result = await api("/api/prompt", {prompt: $("prompt-text").value, top_k: 5, answer: answer || null});
  const strip = $("prompt-tokens");
  strip.replaceChildren();
  result.tokens.forEach((token, i) => {
    const box = el("span", {class: "prompt-token"});
    box.append(el("span", {class: "token"}, token));
    for (const guess of result.top[i].slice(0, 3)) box.append(el("small", {}, `${guess.token} ${(100 * guess.prob).toFixed(1)}%`));
    box.title = result.top[i].map((g) => `${JSON.stringify(g.token)} ${g.prob.toPrecision(4)}`).join("\n");
    strip.append(box);
  });
  Plotly.react("prompt-lens", [{
    type: "heatmap", z: result.lens_probs, x: uniqueLabels(result.tokens), y: result.lens_labels,
    customdata: result.lens_ranks, colorscale: "Viridis", zmin: 0, zmax: 1,
    hovertemplate: "%{y} at %{x}<br>p = %{z:.4f}, rank %{customdata}<extra></extra>",
  }], {title: {text: `logit lens: probability of ${JSON.stringify(result.answer)} by layer and position`},
      margin: {l: 80, b: 110}, xaxis: {tickangle: -60}}, {displayModeBar: false});
}
