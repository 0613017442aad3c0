"""Activation patching of the residual stream, layer × position: where does the answer live?

    python examples/activation_patching.py                      # the embedded IOI model, on CPU in seconds
    python examples/activation_patching.py --model path/to/AFM-4.5B --device cuda --dtype bfloat16
    python examples/activation_patching.py --model path/to/alpha-er.safetensors

Runs the corrupted prompts with the clean run's residual stream written in at one (layer, position)
at a time (denoising; --noising for the reverse), prints the locations that restore the clean answer
most, and writes a heatmap. --attribution adds the gradient estimate of the same sweep.
"""

import time
from pathlib import Path

import torch

from common import arguments, load_model, make_task, out_path
from hooked_models import patching


def main() -> None:
    parser = arguments(__doc__.split("\n")[0], "activation_patching")
    parser.add_argument("--value", default="layer_input",
                        help="what to patch, by layer × position: layer_input, layer_mid, attention_output, "
                             "mlp_output, ... (default: %(default)s)")
    parser.add_argument("--noising", action="store_true", help="write corrupted activations into the clean run")
    parser.add_argument("--attribution", action="store_true", help="also run attribution patching and compare")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    args.out = out_path(args)

    start = time.perf_counter()
    model = load_model(args)
    task = make_task(model, args.prompts, args.seed)
    print(f"{type(model).__name__} ({model.cfg.num_layers} layers) on {args.device} in {args.dtype}; "
          f"task: {task.name}, {task.clean.shape[0]} prompt pairs of {task.clean.shape[1]} tokens")
    direction = "noising" if args.noising else "denoising"
    result = patching.activation_patch(
        model, task.clean, task.corrupted, task.metric, args.value, ("layer", "pos"), direction=direction,
        batch_size=args.batch_size, position_labels=task.position_labels,
    )
    print(f"logit difference: clean {result.clean_metric:.3f}, corrupted {result.corrupted_metric:.3f}")
    print(f"strongest locations ({direction}; restored = 0 for the corrupted run, 1 for the clean run):")
    values, restored = result.values.flatten(), result.normalized().flatten()
    effect = result.effect().abs().flatten()
    for i in effect.argsort(descending=True)[:args.top].tolist():
        if effect[i] < 0.01 * effect.max():
            break  # the rest move the metric by less than 1% of the strongest
        print(f"  {result.location(i):<28} logit diff {float(values[i]):8.3f}   restored {float(restored[i]):6.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result.plot(args.out, title=f"{type(model).__name__}: patching {args.value} ({direction}), {task.name}")
    if args.attribution:
        estimate = patching.attribution_patch(model, task.clean, task.corrupted, task.metric, args.value,
                                              ("layer", "pos"), direction=direction)
        pair = torch.stack([result.effect().flatten(), estimate.effect().flatten()])
        print(f"attribution patching: correlation with activation patching {float(torch.corrcoef(pair)[0, 1]):.3f}")
        estimate_path = Path(args.out).with_name(Path(args.out).stem + "_attribution.png")
        estimate.plot(estimate_path, title=f"attribution estimate of the same sweep ({direction})")
        print(f"wrote {estimate_path}")
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
