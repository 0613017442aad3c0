"""The matrix products an attribution graph's backward passes cannot avoid, counted, against what this
machine's single-thread matrix products deliver: a lower bound on any implementation's time for the
backward-bound rows of the circuit-tracer comparison (benchmarks/circuit_tracer_compare.py), beside what
ours runs.

    python benchmarks/attribution_floor.py      # writes benchmarks/results/attribution_floor.json

A row of the graph is one target's direction carried back through the frozen replacement model to every
source (circuit-tracer's method and ours). Per position it passes, an attention layer costs its output and
value projections' products (hidden x heads·head_dim + hidden x kv_heads·head_dim multiply-adds), a layer's
transcoder skip connection hidden x hidden, and the dot products with the sources' writes hidden each. A
target at layer L and position p reads nothing after p (causal attention) and nothing above its layer: its
row needs (p + 1) positions of L + 1 attention layers and L skips, the **floor** counted here (a logit: every
layer, plus the unembedding at its position). circuit-tracer runs every target over the whole prompt
(`full`); ours each target from its own layer over its own positions (`ours`: every product `attribute`
ran, its forward's too, counted by torch's `FlopCounterMode`). The floor is a count of this method as both tools run it, dense products over
each position carried, not a bound on every implementation: `tight` counts what one could still skip,
skipped (`tight_row_products`: the top layer's output projection at the target's position alone, layer 0's
value projection and position 0 replaced by dot products with precomputed vectors). The times at the best
measured rate of `torch.mm` (one thread; [M hidden] x [hidden hidden], M from 64 to 512) are what the
products alone take, before any other cost.

The cases are the comparison's random and held-out ones (the embedded Arcee's rows are not backward-bound),
the same models, transcoders, prompts and feature budgets (batch 16), built as its driver builds them.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.circuit_tracer_compare import CASES, PROMPT, continued, jumprelu_transcoders, random_arcee  # noqa: E402
from benchmarks.common import Results  # noqa: E402


def per_position(cfg, transcoders) -> tuple[int, int]:
    """(an attention layer's products, a skip connection's) per position, in multiply-adds."""
    attention = cfg.hidden_size * (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
    return attention, (transcoders.d_in * transcoders.d_out if transcoders.has_skip else 0)


def row_products(cfg, transcoders, layer: int | None, positions: int, n_sources: int) -> int:
    """A row's products over `positions` positions: layer None is a logit (every layer and the unembedding)."""
    attention, skip = per_position(cfg, transcoders)
    if layer is None:
        return positions * cfg.num_layers * (attention + skip) + cfg.vocab_size * cfg.hidden_size
    return positions * ((layer + 1) * attention + layer * skip) + n_sources * cfg.hidden_size


def tight_row_products(cfg, transcoders, layer: int | None, position: int, n_sources: int,
                       position_zero: bool) -> int:
    """A row's products with what an implementation could still skip, skipped (ours and circuit-tracer's
    run them as dense products), the patterns' mixing left out as in `row_products`:
    - the top attention layer's output projection at the target's own position only (every other
      position's gradient is zero there), and its value projection as one [hidden] vector per head
      (the gradient at each position is that head's pattern entry times it) where that is cheaper;
    - layer 0's value projection, replaced by dot products with the prompt's value vectors (what
      reaches the embeddings through it);
    - position 0 when its features are not nodes (`position_zero` False: its errors are zero, and what
      reaches its embedding is one dot product per layer with a precomputed value vector).
    Layer None is a logit: the last layer's skip at its position only, the unembedding once."""
    _, skip = per_position(cfg, transcoders)
    hidden, heads, kv, head_dim = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out_proj, value_proj = hidden * heads * head_dim, hidden * kv * head_dim
    n = position + 1 - (0 if position_zero else 1)  # the positions carried
    top = cfg.num_layers - 1 if layer is None else layer
    if top == 0:  # straight to the embeddings' value vectors
        at_top = out_proj + n * heads * head_dim
    else:
        at_top = out_proj + min(n * value_proj, heads * head_dim * hidden)
    below = top * n * (out_proj + skip) + max(top - 1, 0) * n * value_proj + (n * kv * head_dim if top else 0)
    zero = 0 if position_zero else heads * head_dim + top * kv * head_dim
    if layer is None:
        return skip + at_top + below + zero + cfg.vocab_size * hidden
    return at_top + below + zero + n_sources * hidden


def matmul_rate(hidden: int, repeats: int = 20) -> dict:
    """The median GFLOP/s of [M hidden] x [hidden hidden] at each M, one thread."""
    rates = {}
    weight = torch.randn(hidden, hidden)
    for m in (64, 128, 256, 512):
        x = torch.randn(m, hidden)
        torch.mm(x, weight)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(x, weight)
            times.append(time.perf_counter() - start)
        rates[m] = 2 * m * hidden * hidden / statistics.median(times) / 1e9
    return rates


def count(case, model, transcoders, tokens) -> dict:
    """The case's graph built once (batch 16), its rows' floor and full-prompt products, and ours as run: every
    matrix product of the call (its forward too), counted by torch's `FlopCounterMode`."""
    from torch.utils.flop_counter import FlopCounterMode

    from hooked_models.attribution import attribute

    with FlopCounterMode(display=False) as counter:
        graph = attribute(model, tokens, transcoders, batch_size=16, max_feature_nodes=case.max_feature_nodes,
                          desired_logit_prob=0.99999, head_loadings=False)
    cfg, seq = model.cfg, tokens.shape[-1]
    n_sources = graph.n_features + graph.n_layers * seq + seq
    floor = full = tight = 0
    for layer, pos, _ in graph.active_features.tolist():
        floor += row_products(cfg, transcoders, layer, pos + 1, n_sources)
        full += row_products(cfg, transcoders, layer, seq, n_sources)
        tight += tight_row_products(cfg, transcoders, layer, pos, n_sources, position_zero=False)
    logits = len(graph.logit_tokens) * row_products(cfg, transcoders, None, seq, n_sources)
    tight += len(graph.logit_tokens) * tight_row_products(cfg, transcoders, None, seq - 1, n_sources, False)
    return {"label": case.label, "tokens": seq, "max_feature_nodes": case.max_feature_nodes,
            "rows": graph.n_features + len(graph.logit_tokens), "floor_macs": floor + logits, "tight_macs": tight,
            "full_macs": full + logits, "ours_macs": counter.get_total_flops() // 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from hooked_models import HookedArcee
    from hooked_models.families import load_model

    results = Results("attribution_floor")
    embedded = load_model("embedded", family="arcee")
    rows, rates = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for index, case in enumerate(CASES):
            if case.model == "embedded":
                continue
            checkpoint = Path(tmp) / f"model-{case.model}"
            if not checkpoint.exists():
                random_arcee(checkpoint, embedded.tokenizer, args.seed, shape=case.model)
            model = HookedArcee.from_pretrained(checkpoint).eval()
            transcoders = jumprelu_transcoders(model, case.d_transcoder, args.seed, case.threshold)
            tokens = continued(embedded.to_tokens(PROMPT), case.tokens, len(embedded.tokenizer), args.seed)[0]
            if model.cfg.hidden_size not in rates:
                rates[model.cfg.hidden_size] = matmul_rate(model.cfg.hidden_size)
            row = {"case": index, **count(case, model, transcoders, tokens),
                   "peak_gflops": max(rates[model.cfg.hidden_size].values())}
            row["floor_s_at_peak"] = 2 * row["floor_macs"] / row["peak_gflops"] / 1e9
            row["tight_s_at_peak"] = 2 * row["tight_macs"] / row["peak_gflops"] / 1e9
            rows.append(row)
            print(row, flush=True)
    path = results.save({"cases": rows, "matmul_gflops": {str(h): {str(m): r for m, r in by.items()}
                                                           for h, by in rates.items()}})
    print(f"results written to {path}")


if __name__ == "__main__":
    main()
