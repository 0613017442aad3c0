// The prompt view: each position's top predictions and the logit lens of one answer by layer and position.
import {$, BLUES, api, el, showNotices, tokenAxis} from "./common.js";

export async function runPrompt() {
  const answer = $("prompt-answer").value;
  const result = await api("/api/prompt", {prompt: $("prompt-text").value, top_k: 5, answer: answer || null});
  showNotices(result.notices);
  const strip = $("prompt-tokens");
  strip.replaceChildren();
  result.tokens.forEach((token, i) => {
    // padding (alpha-er's window, as generate pads it) is shown faded: its predictions are not the prompt's
    const box = el("span", {class: i < result.real ? "prompt-token" : "prompt-token pad", title: ""});
    box.append(el("span", {class: "token"}, token));
    for (const guess of result.top[i].slice(0, 3)) box.append(el("small", {}, `${guess.token} ${(100 * guess.prob).toFixed(1)}%`));
    box.title = result.top[i].map((g) => `${JSON.stringify(g.token)} ${g.prob.toPrecision(4)}`).join("\n");
    strip.append(box);
  });
  const real = (rows) => rows.map((row) => row.slice(0, result.real));  // the lens over the prompt's positions
  const tokens = result.tokens.slice(0, result.real);
  Plotly.react("prompt-lens", [{
    type: "heatmap", z: real(result.lens_probs), x: tokenAxis(tokens).tickvals, y: result.lens_labels,
    customdata: real(result.lens_ranks), colorscale: BLUES, zmin: 0, zmax: 1, colorbar: {title: {text: "p"}},
    hovertemplate: "%{y} at %{x}<br>p = %{z:.4f}, rank %{customdata}<extra></extra>",
  }], {title: {text: `logit lens: probability of ${JSON.stringify(result.answer)} by layer and position`},
      margin: {l: 80, t: 40}, xaxis: tokenAxis(tokens)}, {displayModeBar: false});
}
