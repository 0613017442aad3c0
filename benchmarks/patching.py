"""Residual-stream patching, layer × position: hooked_models.patching against transformer_lens.patching.

    python benchmarks/patching.py                     # the embedded IOI model, 32 prompt pairs
    python benchmarks/patching.py --model PATH --device cuda --prompts 8

Both sweep every (layer, position) of `layer_input` (TransformerLens's `resid_pre`) on the same model,
prompts and metric: TransformerLens with one forward per patch (`get_act_patch_resid_pre`),
hooked_models with many patched copies of the prompts per forward. The two results are checked to
agree, the runs are interleaved (so load on the machine hits both alike), and the median time of
each and their ratio are printed. Not a test: timings belong here, never in an assertion.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformer_lens.patching as tl_patching

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from common import detect_family, dtype_name, make_task  # noqa: E402

from hooked_models import HookedAlphaEr, HookedArcee, patching  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", type=dtype_name, default="float32")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    family = "arcee" if args.model == "embedded" else detect_family(args.model)
    cls = HookedArcee if family == "arcee" else HookedAlphaEr
    model = cls.from_pretrained(args.model, dtype=args.dtype, device=args.device).eval()
    task = make_task(model, args.prompts, seed=0)
    clean, corrupted = task.clean.to(args.device), task.corrupted.to(args.device)
    cells = model.cfg.n_layers * clean.shape[1]
    print(f"{type(model).__name__} {model.cfg.n_layers} layers, {task.name}: {clean.shape[0]} prompt pairs × "
          f"{clean.shape[1]} positions; {cells} patches per sweep; {torch.get_num_threads()} threads on {args.device}")

    def ours():
        return patching.activation_patch(model, clean, corrupted, task.metric, "layer_input", ("layer", "pos"),
                                         progress=False).values

    def theirs():
        with torch.no_grad():
            _, cache = model.run_with_cache(clean, names_filter=lambda name: name.endswith("layer_input"))
            return tl_patching.get_act_patch_resid_pre(model, corrupted, cache, task.metric).float().cpu()

    import tqdm.auto  # TransformerLens draws a bar per sweep; silence it so that only the sweeps are timed
    tl_patching.tqdm = lambda iterable, **kwargs: iterable
    torch.testing.assert_close(ours(), theirs(), rtol=1e-4, atol=1e-4)
    print("results agree (rtol 1e-4)")
    del tqdm
    times = {"hooked_models": [], "transformer_lens": []}
    for _ in range(args.repeats):
        for name, sweep in (("hooked_models", ours), ("transformer_lens", theirs)):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            sweep()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    ours_s, theirs_s = statistics.median(times["hooked_models"]), statistics.median(times["transformer_lens"])
    print(f"hooked_models.patching:            {ours_s * 1e3:9.1f} ms per sweep (median of {args.repeats})")
    print(f"transformer_lens.patching:         {theirs_s * 1e3:9.1f} ms per sweep")
    print(f"speed-up: {theirs_s / ours_s:.1f}x")


if __name__ == "__main__":
    main()
