"""Attribution graphs: time and peak memory against prompt length and feature count.

    python benchmarks/attribution.py --threads 1                 # embedded models and a random 8 x 1024 Arcee
    python benchmarks/attribution.py --afm                       # AFM-4.5B's shape (~9.3 GB in /tmp, ~14 GB RAM)
    python benchmarks/attribution.py --files                     # graph files' sizes at 25, 500, 5,000 nodes
    python benchmarks/attribution.py --scale                     # 8 x 1024 Arcee, 64 tokens, 2,048 features, QK
    python benchmarks/attribution.py --alpha-er                  # released-size alpha-er, 512 tokens, 2,048 features

Each run is one `attribute(model, prompt, transcoders, ...)`: CPU seconds of this process, wall seconds,
and the peak resident memory during the call (the kernel's high-water mark, reset before each call
through /proc/self/clear_refs) beside the resident memory before it (model and transcoders). Models:
the embedded Arcee and alpha-er with their shipped transcoders (all features, head loadings on); a
random 8-layer, 1024-wide GQA Arcee (the benchmarks' shape) with random TopK transcoders (k features
per layer and position, so the feature count is layers x positions x k), head loadings off. `--afm`:
the synthetic AFM-4.5B checkpoint of benchmarks/load_4_5b.py in bfloat16 with per-layer transcoders of
8,192 random features (bfloat16) written to safetensors files and read lazily (`--afm-resident`: loaded
whole), a 32-token prompt, 512 features, head loadings and QK for the pruned graph; target peak RSS <= 1.5x
checkpoint + transcoders. `--scale` and `--alpha-er`: head loadings and QK
for the pruned graph, with the CPU seconds of each phase; `--alpha-er` is a random alpha-er of the released
size (2 layers x 1024, 64 experts) on one prompt of its whole context (block_size, 512 tokens: its sequence
length is part of the architecture) with random TopK transcoders of 4,096 features, k = 16 (16,384 active).
Results go to benchmarks/results/attribution.json (--afm: attribution_afm.json; --scale, --alpha-er,
--files: attribution_scale.json, attribution_alpha_er.json, attribution_files.json), which
benchmarks/figures.py renders into the READMEs.
"""

import argparse
import ctypes
import gc
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, hf_arcee_config, memory, randomize_  # noqa: E402
from hooked_models import HookedArcee  # noqa: E402
from hooked_models.attribution import attribute  # noqa: E402
from hooked_models.families import load_model  # noqa: E402
from hooked_models.transcoders import Transcoder, TranscoderSet, init_transcoder_, load_transcoders  # noqa: E402


def reset_peak() -> None:
    """Return freed memory to the system (glibc's malloc_trim), then reset this process's VmHWM to its
    current RSS (Linux: clear_refs 5), so the peak is this call's and not a reuse of an earlier one's."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def measure(model, tokens, transcoders, **kwargs) -> dict:
    reset_peak()
    before = memory("VmRSS")
    cpu, wall = time.process_time(), time.perf_counter()
    graph = attribute(model, tokens, transcoders, **kwargs)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    peak = memory("VmHWM")
    attention = {} if graph.loading_edges is None else {
        "loading_edges": len(graph.loading_edges), "qk_tables": len(graph.qk_tables or {}),
        "kept_nodes": int(graph.prune(kwargs.get("node_threshold", 0.8), kwargs.get("edge_threshold", 0.98)).node_mask.sum())}
    return {"seq": int(tokens.shape[-1]), "features": graph.n_features, "nodes": graph.n_nodes, **attention,
            "cpu_s": round(cpu, 3), "wall_s": round(wall, 3), "rss_before_bytes": before, "peak_rss_bytes": peak,
            "peak_increase_bytes": peak - before, **{k: v for k, v in kwargs.items() if k != "progress"}}


def random_transcoder(model, layer: int, d_transcoder: int, k: int, dtype=torch.float32, seed: int = 0) -> Transcoder:
    """Layer `layer`'s random TopK transcoder (`init_transcoder_`, seeded by seed + layer)."""
    tc = Transcoder(model.cfg.hidden_size, d_transcoder, layer=layer, activation="topk", k=k, dtype=dtype)
    init_transcoder_(tc, seed + layer)
    return tc


def random_transcoders(model, d_transcoder: int, k: int, dtype=torch.float32, seed: int = 0) -> TranscoderSet:
    return TranscoderSet([random_transcoder(model, layer, d_transcoder, k, dtype, seed)
                          for layer in range(model.cfg.num_layers)], model=model)


def random_arcee_8x1024() -> HookedArcee:
    """The benchmarks' random 8-layer, 1024-wide GQA Arcee (seeded)."""
    from transformers import ArceeForCausalLM

    shape = argparse.Namespace(vocab=32000, hidden=1024, intermediate=4096, layers=8, heads=8, kv_heads=2, head_dim=128)
    torch.manual_seed(0)
    return HookedArcee.from_hf(randomize_(ArceeForCausalLM(hf_arcee_config(shape)))).eval()


def random_tokens(model, seq: int, seed: int = 0) -> torch.Tensor:
    tokens = torch.randint(3, model.cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seed))
    tokens[0, 0] = 1  # BOS
    return tokens


def embedded_runs(seqs: dict[str, list[int]], record) -> None:
    for family, lengths in seqs.items():
        model = load_model("embedded", family)
        transcoders = load_transcoders("embedded", model=model)
        for seq in lengths:
            result = measure(model, random_tokens(model, seq), transcoders, head_loadings=True)
            record("embedded", {"model": f"embedded {family}", "d_transcoder": transcoders.d_transcoder, **result})


def random_arcee_runs(seqs: list[int], budgets: list[int | None], all_up_to: int, d_transcoder: int, k: int,
                      record) -> None:
    model = random_arcee_8x1024()
    transcoders = random_transcoders(model, d_transcoder, k)
    for seq in seqs:
        for budget in budgets:
            if budget is None and seq > all_up_to:
                continue  # every feature of a long prompt: more memory than a shared machine spares
            result = measure(model, random_tokens(model, seq), transcoders, max_feature_nodes=budget,
                             head_loadings=False)
            record("random_arcee", {"model": "random Arcee 8 x 1024", "d_transcoder": d_transcoder, "k": k, **result})


def write_random_transcoders(model, directory: Path, d_transcoder: int, k: int, dtype=torch.bfloat16,
                            seed: int = 0) -> int:
    """`random_transcoders`' set written in circuit-tracer's layout one layer at a time (never all resident):
    returns the files' bytes."""
    from safetensors.torch import save_file

    from hooked_models.transcoders import FEATURE_INPUT_HOOK, FEATURE_OUTPUT_HOOK

    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for layer in range(model.cfg.num_layers):
        tc = random_transcoder(model, layer, d_transcoder, k, dtype, seed)
        files.append(f"layer_{layer}.safetensors")
        save_file(tc.state_for_file(), str(directory / files[-1]))
        del tc
    config = {"model_kind": "transcoder_set", "feature_input_hook": FEATURE_INPUT_HOOK,
              "feature_output_hook": FEATURE_OUTPUT_HOOK, "activation": "topk", "k": k,
              "d_transcoder": d_transcoder, "transcoders": files}
    import yaml

    (directory / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return sum((directory / f).stat().st_size for f in files)


def afm_run(directory: Path, keep: bool, max_feature_nodes: int, batch_size: int, seq: int = 32,
            head_loadings: str | bool = "pruned", lazy: bool = True) -> dict:
    """AFM-4.5B's shape, bfloat16, 8,192-feature per-layer transcoders written to safetensors files and
    read lazily (`load_transcoders(dir, lazy=True)`; `lazy=False`: all resident), one `seq`-token prompt,
    head loadings and QK for the pruned graph (unless `head_loadings` is False)."""
    from benchmarks.load_4_5b import write_checkpoint
    from hooked_models.families.arcee import AFM_4_5B

    try:
        if not (directory / "config.json").exists():
            write_checkpoint(AFM_4_5B, directory)
        checkpoint_bytes = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
        model = HookedArcee.from_pretrained(directory, dtype=torch.bfloat16).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        tc_dir = directory / "transcoders"
        transcoder_bytes = write_random_transcoders(model, tc_dir, 8192, 32)
        transcoders = load_transcoders(tc_dir, model=model, lazy=lazy)
        for p in transcoders.parameters():
            p.requires_grad_(False)
        resident = sum(p.numel() * p.element_size() for p in transcoders.parameters())
        result = phased(model, random_tokens(model, seq), transcoders, head_loadings, max_feature_nodes=max_feature_nodes,
                        batch_size=batch_size)
        budget = checkpoint_bytes + transcoder_bytes
        return {"model": "AFM-4.5B shape (synthetic, bfloat16)", "d_transcoder": 8192, "k": 32,
                "lazy_transcoders": lazy, "checkpoint_bytes": checkpoint_bytes, "transcoder_bytes": transcoder_bytes,
                "transcoder_bytes_resident_before": resident,
                "peak_over_checkpoint_plus_transcoders": round(result["peak_rss_bytes"] / budget, 3),
                "target": "<= 1.5", **result}
    finally:
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)


def phased(model, tokens, transcoders, head_loadings: str | bool = "pruned", **kwargs) -> dict:
    """`measure` with the CPU seconds of each phase of `progress=` ("logits", "features", "gradients",
    "decomposition"), head loadings and QK for the pruned graph on."""
    phases: dict[str, float] = {}
    clock = {"phase": None, "at": time.process_time()}

    def progress(step) -> None:
        now = time.process_time()
        if clock["phase"] is not None:
            phases[clock["phase"]] = phases.get(clock["phase"], 0.0) + now - clock["at"]
        clock.update(phase=step.phase, at=now)

    result = measure(model, tokens, transcoders, head_loadings=head_loadings, qk=16, progress=progress, **kwargs)
    return {"phase_cpu_s": {name: round(value, 2) for name, value in phases.items()}, **result}


def scale_run(seq: int = 64, max_feature_nodes: int = 2048, d_transcoder: int = 4096, k: int = 16) -> dict:
    """The random 8 x 1024 Arcee at `seq` tokens, `max_feature_nodes` features, head loadings and QK for the
    pruned graph on: time per phase (from `progress=`), peak memory, the kept graph's size."""
    model = random_arcee_8x1024()
    transcoders = random_transcoders(model, d_transcoder, k)
    result = phased(model, random_tokens(model, seq), transcoders, max_feature_nodes=max_feature_nodes)
    return {"model": "random Arcee 8 x 1024", "d_transcoder": d_transcoder, "k": k, **result}


def alpha_er_run(max_feature_nodes: int = 2048, d_transcoder: int = 4096, k: int = 16) -> dict:
    """A random alpha-er of the released size (2 layers x 1024, 8 heads, 64 experts of 320, ranks 128,
    vocabulary 12,288; benchmarks/alpha_er_reference.py's) on one prompt of block_size (512) tokens, its
    whole context, with random TopK per-layer transcoders (`d_transcoder` wide, `k` active per position:
    2 x 512 x k features): `max_feature_nodes` features, head loadings and QK for the pruned graph, time
    per phase, peak memory, the kept graph's size."""
    from hooked_models import HookedAlphaEr
    from hooked_models.families.alpha_er import ALPHA_ER

    torch.manual_seed(0)
    model = randomize_(HookedAlphaEr(ALPHA_ER)).eval()
    transcoders = random_transcoders(model, d_transcoder, k)
    result = phased(model, random_tokens(model, ALPHA_ER.block_size), transcoders, max_feature_nodes=max_feature_nodes)
    return {"model": "random alpha-er 2 x 1024, 64 experts (released size)", "d_transcoder": d_transcoder, "k": k,
            **result}


def file_sizes(seed: int = 0) -> list[dict]:
    """Graph files of pruned graphs of about 25, 500 and 5,000 nodes: the JSON's bytes (what a viewer loads),
    the side file's, the seconds to parse the JSON, and the unpruned adjacency written as JSON text (what the
    file carried before). Embeddings and logits are always kept, so each size needs a prompt and a model
    with room for it: 25 nodes from an 8-token prompt and 500 from a 64-token one on the embedded Arcee
    (1,024-wide random JumpReLU transcoders), 5,000 from a 64-token prompt on the random 8 x 1024 Arcee
    (4,096-wide, thresholds from 2.7: about 6,300 active features, of which at edge_threshold 0.98 pruning
    can keep some 5,600; from circuit_tracer_compare.py's 2.8, 4,682 active, it keeps 4,301 at most), every
    active feature a node, head loadings and QK for the pruned graph on."""
    import tempfile

    from benchmarks.circuit_tracer_compare import PROMPT, continued, jumprelu_transcoders, random_arcee

    embedded = load_model("embedded", "arcee")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        setups = [(25, embedded, lambda: jumprelu_transcoders(embedded, 1024, seed), 8),
                  (500, embedded, lambda: jumprelu_transcoders(embedded, 1024, seed), 64)]
        big = random_arcee(Path(tmp) / "arcee", embedded.tokenizer, seed)
        setups.append((5000, big, lambda: jumprelu_transcoders(big, 4096, seed, threshold=2.7), 64))
        for target, model, make, seq in setups:
            transcoders = make()
            tokens = continued(model.to_tokens(PROMPT), seq, model.cfg.vocab_size, seed)[:, :seq]
            rows.append({"model": "embedded Arcee" if model is embedded else "random Arcee 8 x 1024",
                         "d_transcoder": transcoders.d_transcoder, "seq": seq,
                         **file_size(model, tokens, transcoders, target, Path(tmp))})
            print(rows[-1], flush=True)
    return rows


def file_size(model, tokens, transcoders, target: int, tmp: Path) -> dict:
    """One graph's file at the node threshold that keeps about `target` nodes."""
    import json

    whole = attribute(model, tokens, transcoders, head_loadings=False)
    # The unpruned adjacency as JSON text (what the file used to carry), from a sample's bytes per entry.
    flat = whole.adjacency_matrix.flatten()
    sample = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:100_000]]
    dense_json = int(len(json.dumps(sample.tolist())) / sample.numel() * flat.numel())
    low, high = 0.0, 1.0
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if int(whole.prune(mid, 0.98).node_mask.sum()) < target else (low, mid)
    del whole
    graph = attribute(model, tokens, transcoders, node_threshold=high, qk=16)
    path = graph.prune(high, 0.98).to_json(tmp / "graph.json")
    side = path.with_name("graph.tensors.safetensors")
    start = time.perf_counter()
    data = json.loads(path.read_text())
    parse = time.perf_counter() - start
    return {"target_nodes": target, "nodes": int(graph.prune(high, 0.98).node_mask.sum()),
            "json_nodes": len(data["nodes"]), "json_links": len(data["links"]),
            "loading_edges": len(graph.loading_edges), "qk_tables": len(graph.qk_tables),
            "json_bytes": path.stat().st_size, "side_bytes": side.stat().st_size, "json_parse_s": round(parse, 4),
            "graph_nodes": graph.n_nodes, "unpruned_adjacency_as_json_bytes": dense_json}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--afm", action="store_true", help="only the AFM-4.5B-shape run")
    parser.add_argument("--files", action="store_true", help="only the graph files' sizes (25, 500, 5,000 nodes)")
    parser.add_argument("--scale", action="store_true",
                        help="only the 8 x 1024 Arcee at 64 tokens, 2,048 features, head loadings and QK on")
    parser.add_argument("--alpha-er", action="store_true",
                        help="only the released-size alpha-er at its block_size (512 tokens), 2,048 features, QK on")
    parser.add_argument("--afm-dir", type=Path, default=Path("/tmp/afm_4_5b_attribution"))
    parser.add_argument("--keep", action="store_true", help="keep the AFM checkpoint")
    parser.add_argument("--afm-features", type=int, default=512, help="max_feature_nodes of the AFM run")
    parser.add_argument("--afm-seq", type=int, default=32, help="the AFM run's prompt length")
    parser.add_argument("--afm-no-heads", action="store_true", help="the AFM run without head loadings and QK")
    parser.add_argument("--afm-resident", action="store_true", help="the AFM run's transcoders all resident")
    parser.add_argument("--batch-size", type=int, default=16, help="the AFM run's targets per backward pass")
    parser.add_argument("--seqs", type=int, nargs="+", default=[8, 16, 32], help="random Arcee prompt lengths")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 256, 0],
                        help="random Arcee max_feature_nodes (0: all)")
    parser.add_argument("--all-up-to", type=int, default=16,
                        help="the all-features run only for prompts up to this long")
    parser.add_argument("--d-transcoder", type=int, default=4096)
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.scale:
        Results("attribution_scale").save(scale_run())
        return
    if args.alpha_er:
        Results("attribution_alpha_er").save(alpha_er_run())
        return
    if args.files:
        Results("attribution_files").save({"files": file_sizes()})
        return
    if args.afm:
        results = Results("attribution_afm")
        figures = afm_run(args.afm_dir, args.keep, args.afm_features, args.batch_size, args.afm_seq,
                          False if args.afm_no_heads else "pruned", lazy=not args.afm_resident)
        print(figures, flush=True)
        results.save(figures)
        return
    results, figures = Results("attribution"), {"embedded": [], "random_arcee": []}

    def record(group: str, result: dict) -> None:
        figures[group].append(result)
        print(result, flush=True)

    embedded_runs({"arcee": [8, 16, 32], "alpha_er": [4, 8, 16]}, record)
    random_arcee_runs(args.seqs, [b or None for b in args.budgets], args.all_up_to, args.d_transcoder, args.k,
                      record)
    results.save(figures)


if __name__ == "__main__":
    main()
