"""alpha-er's experts and factored bottlenecks, patched: which expert and which bottleneck units matter?

    python examples/alpha_er_experts.py                          # the embedded alpha-er model
    python examples/alpha_er_experts.py --model path/to/alpha-er.safetensors

alpha-er routes a token at position t of a length-T sequence to expert floor(t·G/T), so an expert
is a window of positions: patching expert g at layer l writes the clean MLP output into the
positions g owns. Its qkv, attention-output and LM-head projections pass through rank-r
bottlenecks: patching unit r writes one bottleneck coordinate at every position (for the LM head,
after the bottleneck's LayerNorm, where the logits are linear in it). Each sweep is shown with its
attribution-patching estimate (one forward and one backward) beside it.
"""

import time
from pathlib import Path

import torch

from common import arguments, load_model, make_task, out_path
from hooked_models import patching

# (value, axes, title): the experts, then each kind of bottleneck.
SWEEPS = [
    ("mlp_output", ("layer", "expert"), "experts (MLP output of each window)"),
    ("qkv_proj.bottleneck", ("layer", "rank"), "qkv bottleneck units"),
    ("o_proj.bottleneck", ("layer", "rank"), "attention-output bottleneck units"),
    ("lm_head.bottleneck_normed", ("rank",), "LM-head bottleneck units (normed)"),
]


def main() -> None:
    parser = arguments(__doc__.split("\n")[0], "alpha_er_experts", families=("alpha-er",))
    args = parser.parse_args()
    args.out = out_path(args)
    start = time.perf_counter()
    model = load_model(args)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task = make_task(model, args.prompts, args.seed)
    seq = task.clean.shape[1]
    windows = model.layers[0].mlp.expert_index(seq)
    print(f"alpha-er: {model.cfg.n_layers} layers, {model.cfg.mlp_experts} experts; task: {task.name}, "
          f"{seq} positions, so expert g owns positions {seq // model.cfg.mlp_experts}·g … "
          f"(expert of each position: {windows.tolist()})")
    fig, axes = plt.subplots(len(SWEEPS), 2, figsize=(14, 3.2 * len(SWEEPS)), squeeze=False)
    for (value, over, title), (left, right) in zip(SWEEPS, axes):
        exact = patching.activation_patch(model, task.clean, task.corrupted, task.metric, value, over,
                                          batch_size=args.batch_size, position_labels=task.position_labels)
        estimate = patching.attribution_patch(model, task.clean, task.corrupted, task.metric, value, over)
        effect, guess = exact.effect().flatten(), estimate.effect().flatten()
        best = effect.abs().argsort(descending=True)[:3].tolist()
        agree = float(torch.corrcoef(torch.stack([effect, guess]))[0, 1]) if effect.std() > 0 else float("nan")
        print(f"  {title:<38} strongest: " + ", ".join(f"{exact.location(i)} ({float(effect[i]):+.3f})" for i in best)
              + f"; attribution correlation {agree:.2f}")
        exact.plot(ax=left, normalized=False, title=f"{title}: activation patching")
        estimate.plot(ax=right, normalized=False, title=f"{title}: attribution estimate")
    fig.suptitle(f"alpha-er, {task.name}: change in the logit difference from each patch (clean "
                 f"{exact.clean_metric:.3f}, corrupted {exact.corrupted_metric:.3f})")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
