"""Circuit discovery: score every edge with EAP-IG, check it against exact edge patching, and keep the
smallest circuit that recovers the task.

    python examples/circuit_discovery.py                            # the embedded Arcee IOI model
    python examples/circuit_discovery.py --family alpha-er          # the embedded alpha-er model
    python examples/circuit_discovery.py --model path/to/checkpoint # AFM-4.5B or alpha-er, detected

Scores every edge of the model's graph (hooked_models.circuits: heads' query, key and value inputs,
MLPs, the input and the logits) with EAP-IG, compares the scores with the exact effect of patching
each edge alone (for graphs up to --exact-limit edges), measures the faithfulness of the top-k circuit
for growing k (every other edge carrying the corrupted run, exactly), and keeps the smallest circuit
that recovers --target of the logit difference. Writes the circuit's diagram (--out; by default
out/circuit_discovery_FAMILY-MODEL.png) and the faithfulness curve (the same name with _faithfulness).
"""

import time
from pathlib import Path

import torch

from common import arguments, load_model, make_task, out_path
from hooked_models import circuits


def main() -> None:
    parser = arguments(__doc__.split("\n")[0], "circuit_discovery")
    parser.add_argument("--method", choices=circuits.METHODS, default="eap-ig")
    parser.add_argument("--steps", type=int, default=5, help="EAP-IG interpolation steps (default: %(default)s)")
    parser.add_argument("--target", type=float, default=0.9,
                        help="the faithfulness the kept circuit must reach (default: %(default)s)")
    parser.add_argument("--exact-limit", type=int, default=2000,
                        help="patch every edge exactly when the graph has at most this many (default: %(default)s)")
    args = parser.parse_args()
    args.out = out_path(args)

    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = time.perf_counter()
    model = load_model(args)
    task = make_task(model, args.prompts, args.seed)
    run = (model, task.clean.to(args.device), task.corrupted.to(args.device), task.metric)
    graph = circuits.edge_attribution(*run, method=args.method, steps=args.steps, batch_size=args.batch_size)
    print(f"{type(model).__name__} ({model.cfg.n_layers} layers); task: {task.name}, {task.clean.shape[0]} pairs")
    print(f"logit difference: clean {graph.clean_metric:.3f}, corrupted {graph.corrupted_metric:.3f}")
    print(f"{len(graph)} edges scored by {graph.method}")

    if len(graph) <= args.exact_limit:
        exact = circuits.edge_patch(*run, [[e] for e in graph.edges], batch_size=args.batch_size) - graph.clean_metric
        r = float(torch.corrcoef(torch.stack([graph.scores, exact]))[0, 1])
        top = lambda s, k: set(s.abs().argsort(descending=True)[:k].tolist())  # noqa: E731
        k = min(10, len(graph))
        print(f"against exact edge patching: correlation {r:.3f}, top-{k} agreement "
              f"{len(top(graph.scores, k) & top(exact, k)) / k:.2f}")

    ks = sorted({k for k in (0, 1, 2, 3, 5, 8, 10, 15, 20, 30, 40, 60, 80, 120, 160, 250, len(graph))
                 if k <= len(graph)})
    curve = graph.faithfulness_curve(*run, ks, batch_size=args.batch_size)
    print("faithfulness of the top-k circuit: " + ", ".join(f"k={k}: {float(f):.2f}" for k, f in zip(ks, curve)))
    reached = [k for k, f in zip(ks, curve.tolist()) if f >= args.target]
    k = reached[0] if reached else len(graph)
    circuit = graph.top(k)
    print(f"circuit: the top {k} edges keep {float(curve[ks.index(k)]):.2f} of the logit difference")
    for (writer, reader), score in zip(circuit.edges, circuit.scores.tolist()):
        print(f"  {writer:<28} -> {reader:<34} {score:+.3f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    circuit.plot(out, title=f"{type(model).__name__}: the top {k} edges, scored by {graph.method}")
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(ks, curve.numpy(), marker="o")
    ax.axhline(args.target, color="gray", linestyle=":", label=f"target {args.target}")
    ax.set_xscale("symlog", linthresh=1)  # k = 0 (nothing kept) on the axis, then log spacing
    ax.set_xlim(0, ks[-1] * 1.15)
    ticks = [t for t in (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000) if t <= ks[-1]]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("edges kept (top k by |score|)")
    ax.set_ylabel("faithfulness (0: corrupted, 1: clean)")
    ax.set_title(f"{type(model).__name__}: faithfulness of the top-k circuit")
    ax.legend(loc="lower right")
    fig.tight_layout()
    curve_path = out.with_name(out.stem + "_faithfulness.png")
    fig.savefig(curve_path, dpi=110)
    print(f"wrote {out} and {curve_path} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
