"""Attention-head patching: which heads carry the answer, and through which of their inputs?

    python examples/head_patching.py                            # the embedded Arcee model
    python examples/head_patching.py --family alpha-er          # the embedded alpha-er model
    python examples/head_patching.py --model path/to/checkpoint # AFM-4.5B or alpha-er, detected

Patches, one head at a time at every position: each head's output, its queries, its attention
pattern, and (by key/value head, as grouped-query attention shares them) its keys and values.
Prints the strongest heads and writes one figure with a panel per value.
"""

import time
from pathlib import Path

from common import arguments, load_model, make_task, out_path
from hooked_models import patching

# (value, the head axis it is swept over, panel title)
SWEEPS = [
    ("attention_head_outputs", "num_heads", "head output (z)"),
    ("attention_queries", "num_heads", "queries"),
    ("attention_probabilities", "num_heads", "pattern"),
    ("attention_keys", "num_kv_heads", "keys (by key/value head)"),
    ("attention_values", "num_kv_heads", "values (by key/value head)"),
]


def main() -> None:
    parser = arguments(__doc__.split("\n")[0], "head_patching")
    parser.add_argument("--noising", action="store_true", help="write corrupted activations into the clean run")
    args = parser.parse_args()
    args.out = out_path(args)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = time.perf_counter()
    model = load_model(args)
    task = make_task(model, args.prompts, args.seed)
    direction = "noising" if args.noising else "denoising"
    cfg = model.cfg
    print(f"{type(model).__name__}: {cfg.n_layers} layers of {cfg.n_heads} heads over "
          f"{getattr(cfg, 'n_key_value_heads', None) or cfg.n_heads} key/value heads; task: {task.name}")
    fig, axes = plt.subplots(1, len(SWEEPS), figsize=(4 * len(SWEEPS), 1.5 + 0.6 * cfg.n_layers + 1.5),
                             squeeze=False)
    for (value, heads, title), ax in zip(SWEEPS, axes[0]):
        result = patching.activation_patch(model, task.clean, task.corrupted, task.metric, value, ("layer", heads),
                                           direction=direction, batch_size=args.batch_size)
        restored = result.normalized().flatten()
        best = [i for i in restored.abs().argsort(descending=True)[:3].tolist() if abs(restored[i]) >= 0.05]
        found = ", ".join(f"{result.location(i)} ({float(restored[i]):.2f})" for i in best) or "none above 0.05"
        print(f"  {title:<28} strongest: {found}")
        result.plot(ax=ax, title=title)
    fig.suptitle(f"{type(model).__name__}: head patching ({direction}), restored fraction of the logit difference")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"logit difference: clean {result.clean_metric:.3f}, corrupted {result.corrupted_metric:.3f}")
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
