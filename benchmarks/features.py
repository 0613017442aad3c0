"""Every feature's statistics in one pass: its cost against a bare encode pass and against `dashboard` feature
by feature, and its peak memory over a corpus 10x as large.

    flock /tmp/hm-heavy.lock python benchmarks/features.py       # harvests into /tmp (about 0.6 GB), deletes

Two transcoder sets, each over a harvest of the value it reads: the embedded Arcee's shipped ones (2 layers of
256 TopK features) over IOI prompts, and one 8,192-wide TopK transcoder of layer 3 of a random 8 x 1024 Arcee
over random token windows. For each: the CPU time (one thread, median of interleaved rounds) of
`features.statistics` over the harvest, of a bare pass reading the same batches and encoding every layer
(the floor: what any statistic needs), of the logits part alone (every feature's decoder through the
unembedding: fixed per feature, whatever the corpus's length), and of `features.dashboard` for a few
features, scaled to all of them (it reads the whole harvest once per feature). The ratio is given both ways:
with the logits (8,192 x 32,000 dot products of 1,024 for the wide set, a dense product that a chunked top-k
cannot shorten) and without them (`pass_ratio`: the per-batch work the corpus's length multiplies).
Then the peak anonymous memory (RssAnon, sampled every 5 ms) of a child process computing the embedded
statistics over 1x and 10x the corpus, with glibc's default allocator settings and again with its mmap
threshold pinned at 128 KiB (MALLOC_MMAP_THRESHOLD_), to tell the allocator's retention from live data.
Results go to benchmarks/results/features.json, which benchmarks/figures.py renders.
"""

import argparse
import json
import shutil
import statistics as stats_
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, hf_arcee_config, memory, peak_anon_during, randomize_  # noqa: E402

BATCH = 64  # rows per batch, for every contender


def bare_pass(harvest: str, transcoders, layers: list[tuple[str, int | None]]) -> None:
    """Read the harvest a batch at a time and encode every layer: the floor of any statistic."""
    from hooked_models.features.reading import open_harvest

    names = sorted({name for name, _ in layers})
    view = open_harvest(harvest).with_format("torch", columns=[*names, "token_ids"])
    with torch.no_grad():
        for start in range(0, len(view), BATCH):
            rows = view[start:start + BATCH]
            for name, layer in layers:
                (transcoders.encode(layer, rows[name]) if layer is not None and hasattr(transcoders, "n_layers")
                 else transcoders.encode(rows[name]))


def cpu_seconds(fn) -> float:
    began = time.process_time()
    fn()
    return time.process_time() - began


def compare(model, harvest: str, transcoders, layers, dashboards: int, rounds: int) -> dict:
    from hooked_models import features

    def run_statistics():
        features.statistics(harvest, transcoders, model=model, batch_size=BATCH, progress=False)

    from hooked_models.features.statistics import N_LOGITS, _directions, logit_table

    def run_logits():  # the logits part of `statistics`: fixed per feature, whatever the corpus's length
        for _, layer in layers:
            logit_table(model, _directions(transcoders, layer).detach(), N_LOGITS)

    times = {"statistics": [], "bare_encode": [], "logits": []}
    for _ in range(rounds):
        times["bare_encode"].append(cpu_seconds(lambda: bare_pass(harvest, transcoders, layers)))
        times["statistics"].append(cpu_seconds(run_statistics))
        times["logits"].append(cpu_seconds(run_logits))
    n_features = len(layers) * transcoders.d_transcoder
    one = transcoders[layers[0][1]] if hasattr(transcoders, "n_layers") else transcoders
    board = [cpu_seconds(lambda f=f: features.dashboard(model, harvest, one, f, batch_size=BATCH))
             for f in range(dashboards)]
    median = {k: stats_.median(v) for k, v in times.items()}
    return {"features": n_features, "rounds": rounds, "statistics_cpu_s": round(median["statistics"], 3),
            "bare_encode_cpu_s": round(median["bare_encode"], 3),
            "ratio": round(median["statistics"] / median["bare_encode"], 3),
            "logits_cpu_s": round(median["logits"], 3),
            "pass_ratio": round((median["statistics"] - median["logits"]) / median["bare_encode"], 3),
            "dashboards_timed": dashboards, "dashboard_cpu_s_each": round(stats_.median(board), 3),
            "dashboards_all_cpu_s": round(stats_.median(board) * n_features, 1),
            "dashboards_over_statistics": round(stats_.median(board) * n_features / median["statistics"], 1)}


def child(harvest: str) -> None:
    from hooked_models import HookedArcee, features
    from hooked_models.transcoders import load_transcoders

    torch.set_num_threads(1)
    model = HookedArcee.from_pretrained("embedded")
    tcs = load_transcoders("embedded", model=model)
    before = memory("RssAnon")
    peak, cpu = peak_anon_during(lambda: features.statistics(harvest, tcs, model=model, batch_size=BATCH,
                                                             progress=False))
    print(json.dumps({"anon_before_bytes": before, "peak_anon_bytes": peak, "cpu_s": round(cpu, 2)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4096, help="the embedded 1x corpus (IOI prompts of 16 tokens)")
    parser.add_argument("--windows", type=int, default=64, help="the random Arcee's corpus: windows of --seq tokens")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dashboards", type=int, default=3, help="features timed with dashboard, then scaled")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/features_bench"))
    parser.add_argument("--child", metavar="HARVEST", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    from transformers import ArceeForCausalLM

    from hooked_models import HookedArcee, corpus
    from hooked_models.embedded.task import make_ioi_prompts
    from hooked_models.transcoders import Transcoder, init_transcoder_, load_transcoders

    torch.set_num_threads(1)
    record, figures = Results("features"), {}
    names = ["layers.0.mlp_input", "layers.1.mlp_input"]
    try:
        model = HookedArcee.from_pretrained("embedded")
        tcs = load_transcoders("embedded", model=model)
        for scale in (1, 10):
            tokens = make_ioi_prompts(args.prompts * scale, 11).clean_tokens
            corpus.harvest(model, tokens, names, args.dir / f"x{scale}", progress=False)
        figures["embedded"] = {"model": "embedded Arcee", "d_transcoder": tcs.d_transcoder, "layers": 2,
                               "tokens": args.prompts * 16,
                               **compare(model, str(args.dir / "x1"), tcs, [(n, i) for i, n in enumerate(names)],
                                         args.dashboards, args.rounds)}
        print(figures["embedded"], flush=True)
        env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PATH": "/usr/bin:/bin"}
        for suffix, extra in (("", {}), ("_pinned_mmap", {"MALLOC_MMAP_THRESHOLD_": "131072"})):
            for scale in (1, 10):
                done = subprocess.run([sys.executable, __file__, "--child", str(args.dir / f"x{scale}")],
                                      stdout=subprocess.PIPE, text=True, check=True, env={**env, **extra})
                figures[f"memory_x{scale}{suffix}"] = {"tokens": args.prompts * scale * 16,
                                                       **json.loads(done.stdout.strip().splitlines()[-1])}
                print(scale, suffix, figures[f"memory_x{scale}{suffix}"], flush=True)
            grown = [figures[f"memory_x{s}{suffix}"]["peak_anon_bytes"] - figures[f"memory_x{s}{suffix}"]["anon_before_bytes"]
                     for s in (1, 10)]
            figures[f"peak_anon_increase_10x_over_1x{suffix}"] = round(grown[1] / grown[0], 3)

        shape = argparse.Namespace(vocab=32000, hidden=1024, intermediate=4096, layers=8, heads=8, kv_heads=2,
                                   head_dim=128)
        torch.manual_seed(0)
        big = HookedArcee.from_hf(randomize_(ArceeForCausalLM(hf_arcee_config(shape)))).eval()
        big.tokenizer = model.tokenizer  # the embedded one, for the dashboards' token strings
        windows = torch.randint(3, model.cfg.vocab_size, (args.windows, args.seq),
                                generator=torch.Generator().manual_seed(1))
        corpus.harvest(big, windows, ["layers.3.mlp_input"], args.dir / "wide", progress=False)
        wide = Transcoder(1024, 8192, layer=3, activation="topk", k=64)
        init_transcoder_(wide, 3)
        figures["wide"] = {"model": "random Arcee 8 x 1024", "d_transcoder": 8192, "k": 64, "layers": 1,
                           "tokens": args.windows * args.seq,
                           **compare(big, str(args.dir / "wide"), wide, [("layers.3.mlp_input", None)],
                                     args.dashboards, args.rounds)}
        print(figures["wide"], flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    record.save(figures)


if __name__ == "__main__":
    main()
