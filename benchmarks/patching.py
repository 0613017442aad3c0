"""Activation patching: hooked_models.patching against transformer_lens.patching, and the FLOP floor.

    python benchmarks/patching.py --threads 1                # the embedded IOI model (Arcee), 32 prompt pairs
    python benchmarks/patching.py --threads 1 --family alpha-er --sweeps layer_input attention_head_outputs
    python benchmarks/patching.py --size --threads 1         # random Arcee 8 × 1024 and 32 × 1024, induction
    python benchmarks/patching.py --model PATH --device cuda --prompts 8

Both contenders sweep the same model, prompts and metric: TransformerLens with one forward per patch
(`get_act_patch_resid_pre` for `layer_input` by layer × position, `get_act_patch_attn_head_out_all_pos`
for `attention_head_outputs` by layer × head), hooked_models with many patched copies per forward, each
run only over the layers and positions its patch can change. The results are checked to agree (from
the first timed round), the contenders run in turn within each round (so load on the machine hits
both alike), and the median CPU time of each is printed with their ratio. `floor` is the ratio a
perfect skip would reach: the FLOPs of one full forward per patch over the FLOPs of running each patch
only from its layer and its first changed position on (nothing for a patch that changes nothing);
FLOPs are 2 per parameter per position (every expert's, for alpha-er: its floor weighs the layers a
little too much against the head) plus the attention's scores and mix.
Not a test: timings belong here, never in an assertion.

`--size` builds the models itself: Arcee with 8 layers, hidden 1024, 8 query heads over 2 key/value
heads of 128, MLP 4096, vocabulary 8192, YaRN as AFM-4.5B (factor 20 over 4096 positions); and the
same 4x deeper (32 layers). The task is induction on repeated random tokens, 4 pairs × 14 positions.
"""

import argparse
import sys
from pathlib import Path

import torch
import transformer_lens.patching as tl_patching

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.append(str(Path(__file__).resolve().parents[1]))
from common import make_task  # noqa: E402  (examples/common.py)

from benchmarks.common import Results, interleaved, randomize_, timings  # noqa: E402

from hooked_models import HookedArcee, patching  # noqa: E402
from hooked_models.components import RopeConfig  # noqa: E402
from hooked_models.dtypes import dtype_argument, resolve_dtype  # noqa: E402
from hooked_models.families import load_model  # noqa: E402
from hooked_models.families.arcee import ArceeConfig  # noqa: E402

SWEEPS = {
    "layer_input": (("layer", "pos"), tl_patching.get_act_patch_resid_pre),
    "attention_head_outputs": (("layer", "head"), tl_patching.get_act_patch_attn_head_out_all_pos),
}


def sized_arcee(num_layers: int, device: str, dtype: torch.dtype) -> HookedArcee:
    """A random Arcee of the issue's shape (8 × 1024 GQA, YaRN as AFM-4.5B), `num_layers` deep."""
    cfg = ArceeConfig(num_layers=num_layers, hidden_size=1024, num_heads=8, num_kv_heads=2, head_dim=128,
                      intermediate_size=4096, vocab_size=8192, bos_token_id=1,
                      rope=RopeConfig("yarn", theta=10000.0, factor=20.0, original_max_position_embeddings=4096))
    return randomize_(HookedArcee(cfg), seed=num_layers).to(device=device, dtype=dtype).eval()


def floor_ratio(model, clean, corrupted, value: str) -> float:
    """FLOPs of one full forward per patch over a perfect skip's, for the benchmark's sweep of `value`."""
    cfg, (batch, seq) = model.cfg, clean.shape
    layer = 2 * sum(p.numel() for p in model.layers[0].parameters())  # per position, besides attention
    head = 2 * sum(p.numel() for p in model.lm_head.parameters())
    attention = 4 * cfg.num_heads * cfg.head_dim  # per query and key: the scores and the mix

    def work(layers: int, start: int) -> float:  # positions start ... through `layers` layers and the head
        keys = sum(range(start + 1, seq + 1))
        return batch * (layers * ((seq - start) * layer + keys * attention) + (seq - start) * head)

    sites = patching.find_sites(model, value)
    with torch.no_grad():
        _, source = model.run_with_cache(clean, names_filter=[s.name for s in sites])
        _, base = model.run_with_cache(corrupted, names_filter=[s.name for s in sites])
    full = skip = 0.0
    for site in sites:
        differs = (source[site.name] != base[site.name]).any(0)  # [seq hidden_size] or [seq num_heads head_dim]
        if value == "layer_input":  # a patch per position, starting there
            starts = [p if bool(differs[p].any()) else None for p in range(seq)]
        else:  # a patch per head at every position, starting at its first difference
            starts = [next((p for p in range(seq) if bool(differs[p, h].any())), None) for h in range(differs.shape[1])]
        full += len(starts) * work(cfg.num_layers, 0)
        skip += sum(work(cfg.num_layers - site.layer, p) for p in starts if p is not None)
    return full / skip


def compare(model, task, device: str, values: list[str], rounds: int, warmup: int) -> dict:
    """Time both contenders on each sweep, interleaved; check they agree; print the ratios; return the
    figures of each sweep (medians and floor) as JSON."""
    clean, corrupted = task.clean.to(device), task.corrupted.to(device)
    figures = {}
    for value in values:
        over, reference = SWEEPS[value]
        results = {}

        def ours():
            results["ours"] = patching.activation_patch(model, clean, corrupted, task.metric, value, over,
                                                        progress=False).values
            return results["ours"]

        def theirs():
            with torch.no_grad():
                _, cache = model.run_with_cache(clean, names_filter=lambda name: name.endswith(value))
                results["theirs"] = reference(model, corrupted, cache, task.metric).float().cpu()
            return results["theirs"]

        times = interleaved({"hooked_models": ours, "transformer_lens": theirs}, rounds, warmup)
        torch.testing.assert_close(results["ours"], results["theirs"], rtol=1e-4, atol=1e-4)
        (ours_cpu, ours_wall), (theirs_cpu, theirs_wall) = times["hooked_models"], times["transformer_lens"]
        floor = floor_ratio(model, clean, corrupted, value)
        print(f"  {value:<24} {' × '.join(over):<13} hooked_models {ours_cpu * 1e3:9.1f} ms   transformer_lens "
              f"{theirs_cpu * 1e3:9.1f} ms   speed-up {theirs_cpu / ours_cpu:4.2f}x   floor {floor:4.2f}x   "
              f"(wall {ours_wall * 1e3:.0f} / {theirs_wall * 1e3:.0f} ms)")
        figures[value] = {"over": list(over), "floor": round(floor, 4), **timings(times)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded", help="'embedded' or a checkpoint (family detected)")
    parser.add_argument("--family", choices=("arcee", "alpha-er"), default="arcee",
                        help="which embedded model --model embedded means (default: %(default)s)")
    parser.add_argument("--size", action="store_true",
                        help="build random Arcee models of 8 and 32 layers × 1024 (see the docstring) instead")
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 32], help="the --size models' layers")
    parser.add_argument("--sweeps", nargs="+", choices=sorted(SWEEPS), default=None,
                        help="default: both with --size, layer_input otherwise")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", type=dtype_argument, default="float32")
    parser.add_argument("--prompts", type=int, default=None, help="prompt pairs (default: 4 with --size, else 32)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds, the median reported (default: 1 with --size, else 5)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed rounds first (default: 0 with --size, else 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--results", default=None,
                        help="write the figures to benchmarks/results/RESULTS.json (default: patching_size_8_32 "
                             "with --size --depths 8 32, patching_arcee / patching_alpha-er for the embedded models, "
                             "patching_model otherwise)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import tqdm.auto  # noqa: F401  TransformerLens draws a bar per sweep; silence it so that only sweeps are timed
    tl_patching.tqdm = lambda iterable, **kwargs: iterable

    sized = args.size
    default_name = ("patching_size_" + "_".join(map(str, args.depths)) if sized else
                    f"patching_{args.family}" if args.model == "embedded" else "patching_model")
    record = Results(args.results or default_name)
    figures = {}
    rounds = args.repeats or (1 if sized else 5)
    warmup = args.warmup if args.warmup is not None else (0 if sized else 1)
    values = args.sweeps or (list(SWEEPS) if sized else ["layer_input"])
    prompts = args.prompts or (4 if sized else 32)
    if sized:
        models = (sized_arcee(depth, args.device, resolve_dtype(args.dtype)) for depth in args.depths)
    else:
        family = args.family if args.model == "embedded" else None
        models = [load_model(args.model, family, dtype=args.dtype, device=args.device)]
    for model in models:
        task = make_task(model, prompts, seed=0)
        print(f"{type(model).__name__} {model.cfg.num_layers} layers × {model.cfg.hidden_size}, {task.name}: "
              f"{task.clean.shape[0]} prompt pairs × {task.clean.shape[1]} positions; {torch.get_num_threads()} "
              f"threads on {args.device}; median CPU time of {rounds} interleaved round(s)")
        figures[f"{type(model).__name__} {model.cfg.num_layers} x {model.cfg.hidden_size}"] = {
            "pairs": task.clean.shape[0], "positions": task.clean.shape[1], "rounds": rounds,
            "sweeps": compare(model, task, args.device, values, rounds, warmup)}
        del model
    record.save(figures)


if __name__ == "__main__":
    main()
