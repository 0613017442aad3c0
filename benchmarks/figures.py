"""The benchmark figures of the READMEs and the documentation's pages, rendered from the benchmarks' results
files: one source for every figure.

    python benchmarks/figures.py            # rewrite the generated parts of README.md, benchmarks/README.md
                                            # and every docs/**/*.md page that holds one
    python benchmarks/figures.py --check    # exit 1, naming the part, where one differs from its rendering

Each benchmark writes its figures to benchmarks/results/<name>.json (benchmarks/common.py's `Results`: the
command, the date, the machine's load before and after, the medians). Here each generated part of a document
is a function of those files; in the document it sits between `<!-- figures: NAME -->` and `<!-- /figures -->`
(a table, a sentence, or a single figure inside a sentence; the site's build drops the markers,
docs/hooks.py), so a summary row and its table are two renderings of one number and cannot drift apart.
tests/test_benchmark_figures.py checks that every part is what its results render to. The images drawn from
results (`IMAGES`: the transcoder-training FVU-against-L0 plot) carry the numbers they plot in their PNG text,
which the check compares (pixels differ with a machine's fonts).
"""

import argparse
import json
import re
import statistics
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PART = re.compile(r"<!-- figures: (?P<name>[\w-]+) -->(?P<body>.*?)<!-- /figures -->", re.S)
# The documents holding generated parts: the two READMEs, and each page of the site that holds one.
DOCUMENTS = (ROOT / "README.md", ROOT / "benchmarks" / "README.md",
             *(page for page in sorted((ROOT / "docs").rglob("*.md")) if PART.search(page.read_text())))


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def cpu(record: dict, *path: str) -> float:
    """The median CPU seconds of a contender, at `path` under the record's figures."""
    figure = record["figures"]
    for key in path:
        figure = figure[key]
    return figure["cpu_s"]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def when(record: dict) -> str:
    """The date and the machine's load (1-minute load average before and after the run)."""
    loads = [record["machine"][k] for k in ("load_average_before", "load_average_after")]
    if record.get("published") or not all(loads):
        return f"{record['date']}, published figures (not rerun: see its results file)"
    low, high = sorted((loads[0][0], loads[1][0]))
    return f"{record['date'][:10]}, load average {low:.1f}-{high:.1f} on {record['machine']['cores']} cores"


def kept(name: str, before: str = " (", after: str = ")") -> str:
    """A note for figures kept from an earlier run (their results file says "published"), else nothing."""
    record = load(name)
    return f"{before}published {record['date']}, not rerun{after}" if record.get("published") else ""


# ----------------------------------------------------------------------------------------- figures
def forward_ratios(name: str = "forward") -> dict[str, float]:
    r = load(name)
    return {
        "forward": cpu(r, "forward", "HookedArcee") / cpu(r, "forward", "transformers ArceeForCausalLM (sdpa)"),
        "cache": cpu(r, "run_with_cache", "HookedArcee.run_with_cache")
        / cpu(r, "run_with_cache", "TransformerBridge.run_with_cache"),
        "floor": cpu(r, "run_with_cache", "the same matmuls alone (a floor)")
        / cpu(r, "run_with_cache", "TransformerBridge.run_with_cache"),
        "alpha_er": cpu(r, "alpha_er", "HookedAlphaEr") / cpu(r, "alpha_er", "alpha-er reference"),
    }


def sweeps(name: str) -> dict[str, dict]:
    """{sweep: {"speed_up", "floor", "ours", "theirs"}} of a patching results file (one model)."""
    (model,) = load(name)["figures"].values()
    out = {}
    for sweep, f in model["sweeps"].items():
        if "speed_up" in f:  # published figures: the ratios only
            out[sweep] = {"speed_up": f["speed_up"], "floor": f["floor"], "ours": None, "theirs": None}
        else:
            ours, theirs = f["hooked_models"]["cpu_s"], f["transformer_lens"]["cpu_s"]
            out[sweep] = {"speed_up": theirs / ours, "floor": f["floor"], "ours": ours, "theirs": theirs}
    return out


CIRCUIT_MODELS = {"arcee": "HookedArcee embedded (GQA 4/2 heads, 2 layers)",
                  "alpha_er": "HookedAlphaEr embedded (MHA 4 heads, 2 layers)",
                  "mha": "HookedArcee random (MHA 8 heads, 4 layers)"}
TL_EDGE = "TransformerLens attribution_patch, edge"


def circuits() -> dict[str, dict]:
    """Per model: edges and CPU seconds of EAP-IG, EAP, edge_patch of every edge, TransformerLens's edge EAP."""
    r = load("circuits")
    out = {}
    for key, label in CIRCUIT_MODELS.items():
        m = r["figures"]["models"][label]
        ig = next(v["cpu_s"] for k, v in m.items() if k.startswith("circuits EAP-IG"))
        out[key] = {"edges": m["edges"], "ig": ig, "eap": m["circuits EAP"]["cpu_s"],
                    "exact": m["circuits edge_patch, every edge"]["cpu_s"],
                    "tl": m[TL_EDGE]["cpu_s"] if TL_EDGE in m else None}
    return out


def circuit_ranges() -> dict[str, str]:
    c = circuits()
    exact = [c[k]["exact"] / c[k]["ig"] for k in ("arcee", "mha")]
    tl = [(v["tl"] / v["ig"], v["tl"] / v["eap"]) for v in c.values() if v["tl"] is not None]
    return {"exact": f"1/{exact[0]:.0f}", "exact_mha": f"1/{exact[1]:.0f}",
            "exact_all": ", ".join(f"{c[k]['exact'] / c[k]['ig']:.1f}x" for k in CIRCUIT_MODELS),
            "tl_ig": f"{min(t for t, _ in tl):.1f}-{max(t for t, _ in tl):.1f}x",
            "tl_eap": f"{min(e for _, e in tl):.0f}-{max(e for _, e in tl):.0f}x",
            "tl_alpha_er": f"{c['alpha_er']['tl'] / c['alpha_er']['ig']:.1f}x",
            "tl_mha": f"{c['mha']['tl'] / c['mha']['ig']:.1f}x"}


def generate_ratios() -> tuple[float, float]:
    rate = load("generate")["figures"]["tokens_per_s"]
    return rate["HookedArcee"] / rate["transformers"], rate["HookedArcee + hook"] / rate["transformers + hook"]


def corpus() -> dict[str, float]:
    f = load("corpus")["figures"]
    wall = {k: v["wall_s"] for k, v in f["throughput"].items()}
    return {"ray1": wall["ray, 1 worker"] / wall["local"], "ray2": wall["ray, 2 workers"] / wall["local"],
            "memory": f["memory"]["10x"]["peak"] / f["memory"]["1x"]["peak"], "wall": wall, "tokens": f["tokens"],
            "peaks": f["memory"]}


def load_ratio() -> float:
    f = load("load_4_5b")["figures"]
    return f["peak_rss_after_load"] / f["checkpoint_bytes"]


def afm_attribution() -> dict:
    """The AFM-4.5B-shape attribution run: its figures, and its peak over checkpoint + transcoders."""
    f = load("attribution_afm")["figures"]
    return {**f, "ratio": f["peak_rss_bytes"] / (f["checkpoint_bytes"] + f["transcoder_bytes"])}


def attribution_runs(group: str) -> list[dict]:
    return load("attribution")["figures"][group]


def all_features_16() -> dict:
    """The random 8 x 1024 Arcee's run with every feature of a 16-token prompt (the memory row)."""
    (run,) = [r for r in attribution_runs("random_arcee") if r["seq"] == 16 and r["max_feature_nodes"] is None]
    return run


# ----------------------------------------------------------------------------------------- parts
def speed_table() -> str:
    """docs/guide/speed-and-memory.md's table."""
    fw, small = forward_ratios(), forward_ratios("forward_overhead")
    s8, s32 = sweeps("patching_size_8"), sweeps("patching_size_32")
    arcee, alpha = sweeps("patching_arcee"), sweeps("patching_alpha-er")
    cr, co = circuit_ranges(), corpus()
    gen, gen_hook = generate_ratios()
    afm, a16 = afm_attribution(), all_features_16()
    li, ho = "layer_input", "attention_head_outputs"
    rows = [
        ("`HookedArcee` forward / transformers `ArceeForCausalLM` (sdpa)", f"{fw['forward']:.3f}x", "<= 1.05x"),
        ("`run_with_cache` of every hook / TransformerLens 4.3 `TransformerBridge` `run_with_cache`",
         f"{fw['cache']:.3f}x", f"<= 0.8x (not met: its matrix multiplications alone take {fw['floor']:.3f}x)"),
        ("same, overhead-bound shape (8 layers x 64 wide, 1 x 16)", f"{small['cache']:.2f}x", ""),
        ("activation patching / `transformer_lens.patching` (one forward per patch), random Arcee 8 layers x 1024 "
         "(GQA 8/2 x 128, MLP 4096, vocab 8192, YaRN as AFM), induction 4 pairs x 14 positions: `layer_input` by "
         "layer x position (`get_act_patch_resid_pre`)",
         f"{s8[li]['speed_up']:.2f}x faster (FLOP floor {s8[li]['floor']:.2f}x)", ">= 3.5x"),
        ("same model, `attention_head_outputs` by layer x head, all positions (`get_act_patch_attn_head_out_all_pos`)",
         f"{s8[ho]['speed_up']:.2f}x faster (floor {s8[ho]['floor']:.2f}x)", ">= 1.8x"),
        (f"same two sweeps, 32 layers x 1024{kept('patching_size_32')}",
         f"{s32[li]['speed_up']:.2f}x / {s32[ho]['speed_up']:.2f}x faster (floors {s32[li]['floor']:.2f}x / "
         f"{s32[ho]['floor']:.2f}x)", ""),
        ("same two sweeps, embedded IOI models (32 pairs x 16 positions), Arcee / alpha-er",
         f"{arcee[li]['speed_up']:.1f}x / {arcee[ho]['speed_up']:.1f}x, {alpha[li]['speed_up']:.1f}x / "
         f"{alpha[ho]['speed_up']:.1f}x faster", "no slower than before (5.9x)"),
        ("`HookedAlphaEr` forward / the reference arithmetic (released size, 4 x 256)", f"{fw['alpha_er']:.2f}x", ""),
        (f"peak memory loading a synthetic AFM-4.5B checkpoint ({load('load_4_5b')['figures']['checkpoint_bytes'] / 1e9:.2f}"
         f" GB bf16, {load('load_4_5b')['figures']['shards']} shards{kept('load_4_5b', '; ', '')})",
         f"{load_ratio():.2f}x its size, {load('load_4_5b')['figures']['load_s']:.1f} s", "<= 1.15x"),
        ("`generate` tokens/s / transformers `generate` (4 layers x 512, batch 1, 64 tokens)",
         f"{gen:.2f}x ({gen_hook:.2f}x with a hook each)", ""),
        ("every edge's EAP-IG score (5 steps) / TransformerLens 4.3 edge `attribution_patch` (plain EAP; embedded "
         "alpha-er, 16 pairs)", f"{cr['tl_alpha_er']} faster ({cr['tl_mha']} on a 4-layer, 8-head MHA Arcee)", ""),
        ("`corpus.harvest` time, Ray with 1 worker / local (4 layers x 256, 262k tokens, wall clock)",
         f"{co['ray1']:.2f}x (2 workers: {co['ray2']:.2f}x)", "<= 1.3x"),
        ("peak memory of a harvest over 10x the corpus / 1x (same batch size)", f"{co['memory']:.3f}x", "<= 1.2x"),
        (f"peak memory of `attribute` at AFM-4.5B's shape (bf16, 36 transcoders of 8,192 features, 16 tokens, "
         f"{afm['nodes']} nodes) / checkpoint + transcoders", f"{afm['ratio']:.3f}x, {afm['wall_s'] / 60:.1f} min",
         "<= 1.5x " + ("met" if afm["ratio"] <= 1.5 else "**not met**")),
        (f"`attribute` on the random 8 x 1024 Arcee, every feature of 16 tokens ({a16['nodes']} nodes): peak above "
         "the loaded model", f"{a16['peak_increase_bytes'] / 1e9:.2f} GB, {a16['cpu_s']:.1f} CPU s", ""),
    ]
    lines = ["| | ratio | target |", "|---|---:|---|"] + [f"| {a} | {b} | {t} |" for a, b, t in rows]
    return "\n".join(lines)


def measured() -> str:
    """When and under what load the figures were measured, from the results files."""
    names = sorted(p.stem for p in RESULTS.glob("*.json"))
    records = [load(n) for n in names]
    measured = [r for r in records if not r.get("published")]
    loads = [x for r in measured for x in (r["machine"]["load_average_before"][0], r["machine"]["load_average_after"][0])]
    dates = sorted({r["date"][:10] for r in measured})
    published = ", ".join(f"`{r['benchmark']}` ({r['date']})" for r in records if r.get("published"))
    versions = sorted({", ".join(f"{k} {v}" for k, v in r["versions"].items() if v) for r in measured})
    text = (f"Measured {' and '.join(dates)} ({'; '.join(versions)}) on a 2-core machine shared with other "
            f"developers' jobs: load average "
            f"{min(loads):.1f} to {max(loads):.1f} during the runs (each results file records its own). CPU time of "
            f"the benchmark process, one thread, contenders interleaved (the corpus rows: wall clock, median of "
            f"{load('corpus')['figures']['rounds']}, which such load stretches at random)."
            + (f" Kept from earlier runs, not rerun: {published}." if published else ""))
    return textwrap.fill(text, 110, break_on_hyphens=False)


def summary_table() -> str:
    """benchmarks/README.md's summary: one row per comparison, the command that measures it."""
    fw, small = forward_ratios(), forward_ratios("forward_overhead")
    rows = []
    commands = {n: load(n)["command"] for n in ("forward", "forward_overhead", "patching_size_8", "patching_size_32",
                                                 "patching_arcee", "patching_alpha-er", "generate", "circuits",
                                                 "load_4_5b", "corpus", "attribution", "attribution_afm",
                                                 "train_transcoders_afm", "train_transcoders_afm_sharded",
                                                 "transcoder_training")}
    s8, s32 = sweeps("patching_size_8"), sweeps("patching_size_32")
    arcee, alpha = sweeps("patching_arcee"), sweeps("patching_alpha-er")
    cr, co = circuit_ranges(), corpus()
    gen, gen_hook = generate_ratios()
    li, ho = "layer_input", "attention_head_outputs"

    def sweep_cell(s, sweep):
        times = f"; {s[sweep]['ours'] * 1e3:,.0f} vs {s[sweep]['theirs'] * 1e3:,.0f} ms" if s[sweep]["ours"] else ""
        return f"{s[sweep]['speed_up']:.2f}x (floor {s[sweep]['floor']:.2f}x{times})"

    rows += [
        (commands["forward"], "`HookedArcee` forward / transformers (sdpa)", f"{fw['forward']:.3f}"),
        ("", "`run_with_cache` of every hook / TransformerBridge `run_with_cache`",
         f"{fw['cache']:.3f} (floor {fw['floor']:.3f})"),
        ("", "`HookedAlphaEr` forward / the reference", f"{fw['alpha_er']:.3f}"),
        (commands["forward_overhead"], "overhead-bound shape: `run_with_cache` / the bridge's", f"{small['cache']:.3f}"),
        (commands["patching_size_8"], "8 × 1024: `layer_input` layer × pos, TL / ours", sweep_cell(s8, li)),
        ("", "8 × 1024: `attention_head_outputs` layer × head, TL / ours", sweep_cell(s8, ho)),
        (commands["patching_size_32"], f"32 × 1024, the same two sweeps (1 round{kept('patching_size_32', '; ', '')})",
         f"{s32[li]['speed_up']:.2f}x / {s32[ho]['speed_up']:.2f}x (floors {s32[li]['floor']:.2f}x / "
         f"{s32[ho]['floor']:.2f}x)"),
        (commands["patching_arcee"], "embedded Arcee, the same two sweeps",
         f"{arcee[li]['speed_up']:.2f}x / {arcee[ho]['speed_up']:.2f}x"),
        (commands["patching_alpha-er"], "embedded alpha-er", f"{alpha[li]['speed_up']:.2f}x / {alpha[ho]['speed_up']:.2f}x"),
        (commands["generate"], "`generate` tokens/s / transformers' (plain; each with a hook)",
         f"{gen:.2f}; {gen_hook:.2f}"),
        (commands["circuits"], "TL edge `attribution_patch` / our EAP-IG (5 steps): embedded alpha-er; 4-layer "
         "8-head MHA Arcee", f"{cr['tl_alpha_er']}; {cr['tl_mha']}"),
        ("", "`edge_patch` of every edge / EAP-IG: embedded Arcee, embedded alpha-er, MHA Arcee", cr["exact_all"]),
        (commands["load_4_5b"], f"peak RSS loading AFM-4.5B's shape / its checkpoint{kept('load_4_5b')}",
         f"{load_ratio():.3f}"),
        (commands["corpus"], "harvest, Ray 1 worker / local (wall clock)", f"{co['ray1']:.2f} (2 workers: {co['ray2']:.2f})"),
        ("", "peak RSS, 10x the corpus / 1x", f"{co['memory']:.3f}"),
        (commands["attribution_afm"], "`attribute` at AFM-4.5B's shape: peak RSS / (checkpoint + transcoders)",
         f"{afm_attribution()['ratio']:.3f}"),
        (commands["attribution"], "`attribute`, 8 x 1024 Arcee, every feature of 16 tokens: peak above the model "
         "/ the model's RSS", f"{all_features_16()['peak_increase_bytes'] / all_features_16()['rss_before_bytes']:.3f}"),
        (commands["train_transcoders_afm"], "streamed training of one layer's 8,192-wide TopK transcoder at "
         "AFM-4.5B's shape: peak RSS / (checkpoint + parameters + Adam)", f"{afm_training()['ratio']:.3f}"),
        (commands["train_transcoders_afm_sharded"], "36-layer cross-layer transcoder, features over 2 processes: "
         "each process's parameters / the whole", ", ".join(f"{s['parameter_bytes'] / sharded_whole():.4f}"
                                                            for s in load("train_transcoders_afm_sharded")
                                                            ["figures"]["shards"])),
        (commands["transcoder_training"], "transcoders trained on the same tokens (k=16): FVU per layer, then CPU "
         "time per token, ours at its tuned lr / sparsify's best Adam", sparsify_ratios()),
    ]
    lines = ["| command | comparison | ratio |", "|---|---|---:|"]
    lines += [f"| {f'`{cmd}`' if cmd else ''} | {what} | {ratio} |" for cmd, what, ratio in rows]
    return "\n".join(lines)


def forward_table() -> str:
    r, fw = load("forward"), forward_ratios()
    f = r["figures"]
    hf, bridge = "transformers ArceeForCausalLM (sdpa)", "TransformerBridge.run_with_cache"
    counts = f["cached_values"]
    rows = [
        ("transformers `ArceeForCausalLM` (sdpa), forward", cpu(r, "forward", hf), "1.000", ""),
        ("`HookedArcee`, forward, no hooks", cpu(r, "forward", "HookedArcee"), f"**{fw['forward']:.3f}**",
         "<= 1.05 " + ("met" if fw["forward"] <= 1.05 else "**not met**")),
        (f"TransformerLens 4.3 `TransformerBridge.boot_transformers(dir)`, `run_with_cache` "
         f"({counts['TransformerBridge']} values)", cpu(r, "run_with_cache", bridge), "1.000", ""),
        (f"`HookedArcee.run_with_cache`, every hook ({counts['HookedArcee']} values)",
         cpu(r, "run_with_cache", "HookedArcee.run_with_cache"), f"**{fw['cache']:.3f}**", "<= 0.8 **not met**"),
        ("the same matrix multiplications alone (`gemm_floor`)",
         cpu(r, "run_with_cache", "the same matmuls alone (a floor)"), f"**{fw['floor']:.3f}**", "the floor"),
        ("alpha-er reference (plain torch, `alpha_er_reference.py`), released size, 4 x 256",
         cpu(r, "alpha_er", "alpha-er reference"), "1.000", ""),
        ("`HookedAlphaEr` forward", cpu(r, "alpha_er", "HookedAlphaEr"), f"**{fw['alpha_er']:.3f}**", ""),
    ]
    lines = ["| contender | CPU time | ratio | target |", "|---|---:|---:|---|"]
    lines += [f"| {a} | {ms(t)} | {ratio} | {target} |" for a, t, ratio, target in rows]
    above_bridge = 1 - fw["floor"]
    above_ours = fw["cache"] - fw["floor"]
    lines += ["", f"Measured {when(r)}. The floor alone takes {fw['floor']:.3f}x the bridge's `run_with_cache`; above "
              f"it, the bridge spends {above_bridge:.1%} of its time and we spend {above_ours:.1%} (of the bridge's)."]
    return "\n".join(lines)


def overhead_table() -> str:
    r, small = load("forward_overhead"), forward_ratios("forward_overhead")
    hf, bridge = "transformers ArceeForCausalLM (sdpa)", "TransformerBridge.run_with_cache"
    rows = [("transformers forward", cpu(r, "forward", hf), "1.000"),
            ("`HookedArcee` forward", cpu(r, "forward", "HookedArcee"), f"{small['forward']:.3f}"),
            ("bridge `run_with_cache`", cpu(r, "run_with_cache", bridge), "1.000"),
            ("`HookedArcee.run_with_cache`", cpu(r, "run_with_cache", "HookedArcee.run_with_cache"),
             f"**{small['cache']:.3f}**"),
            ("the same matrix multiplications alone", cpu(r, "run_with_cache", "the same matmuls alone (a floor)"),
             f"{small['floor']:.3f}")]
    lines = ["| contender | CPU time | ratio |", "|---|---:|---:|"]
    lines += [f"| {a} | {ms(t)} | {ratio} |" for a, t, ratio in rows]
    return "\n".join(lines + ["", f"Measured {when(r)}."])


def patching_table() -> str:
    li, ho = "layer_input", "attention_head_outputs"
    models = [("8 x 1024", "patching_size_8"), ("32 x 1024", "patching_size_32"),
              ("embedded Arcee (IOI, 32 pairs x 16)", "patching_arcee"), ("embedded alpha-er", "patching_alpha-er")]
    targets = {("patching_size_8", li): ">= 3.5x", ("patching_size_8", ho): ">= 1.8x"}
    names = {li: "`layer_input`, layer x position", ho: "`attention_head_outputs`, layer x head, all positions"}
    lines = ["| model | sweep | hooked_models | TransformerLens | speed-up | floor | target | measured |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for label, name in models:
        record = load(name)
        (model,) = record["figures"].values()
        for sweep, s in sweeps(name).items():
            target = targets.get((name, sweep), "")
            if target:
                target += " met" if s["speed_up"] >= float(target[3:-1]) else " **not met**"
            ours = ms(s["ours"]) if s["ours"] else "(not published)"
            theirs = ms(s["theirs"]) if s["theirs"] else "(not published)"
            lines.append(f"| {label} | {names[sweep]} | {ours} | {theirs} | **{s['speed_up']:.2f}x** | "
                         f"{s['floor']:.2f}x | {target} | {when(record)}; median of {model['rounds']} |")
    return "\n".join(lines)


def key_value_table(rows: list[tuple[str, str]], record: dict) -> str:
    """A two-column table of (what, figure) rows, then when and under what load they were measured."""
    lines = ["| | |", "|---|---:|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines + ["", f"Measured {when(record)}."])


def load_table() -> str:
    r = load("load_4_5b")
    f = r["figures"]
    rows = [("checkpoint", f"{f['checkpoint_bytes'] / 1e9:.2f} GB in {f['shards']} shards"),
            ("load time (progress bar shown)", f"{f['load_s']:.1f} s"),
            ("peak RSS of the loading process (VmHWM)",
             f"{f['peak_rss_after_load'] / 1e9:.2f} GB = **{load_ratio():.3f}x** the checkpoint (target <= 1.15x)"),
            ("of which interpreter + imports before loading", f"{f['baseline_rss'] / 1e9:.2f} GB"),
            ("bfloat16 forward, 1 x 16 tokens, CPU", f"{f['forward_s']:.1f} s, finite logits: {f['logits_finite']}")]
    return key_value_table(rows, r)


def circuits_table() -> str:
    r, c = load("circuits"), circuits()
    labels = {"arcee": "embedded Arcee (GQA 4/2 heads, 2 layers)",
              "alpha_er": "embedded alpha-er (MHA 4 heads, 2 layers, 4 experts)",
              "mha": "random Arcee (MHA 8 heads, 4 layers, hidden 128)"}
    lines = ["| model | edges | EAP-IG (5 steps) | EAP | `edge_patch`, every edge | TransformerLens edge EAP |",
             "|---|---:|---:|---:|---:|---:|"]
    for key, v in c.items():
        tl = f"{ms(v['tl'])} ({v['tl'] / v['ig']:.1f})" if v["tl"] is not None else "refuses GQA"
        lines.append(f"| {labels[key]} | {v['edges']} | {ms(v['ig'])} (1.0) | {ms(v['eap'])} ({v['eap'] / v['ig']:.2f}) | "
                     f"{ms(v['exact'])} ({v['exact'] / v['ig']:.1f}) | {tl} |")
    return "\n".join(lines + ["", f"Measured {when(r)}; median of {r['figures']['rounds']} interleaved rounds."])


def circuits_sentence() -> str:
    cr = circuit_ranges()
    return (f"every edge's EAP-IG score costs {cr['exact']} (embedded Arcee) to {cr['exact_mha']} (a 4-layer, 8-head "
            f"Arcee, {circuits()['mha']['edges']} edges) of patching every edge exactly, and TransformerLens's edge EAP "
            f"takes {cr['tl_ig']} our EAP-IG and {cr['tl_eap']} our EAP")


def corpus_tables() -> str:
    r, co = load("corpus"), corpus()
    wall, tokens = co["wall"], co["tokens"]
    lines = ["| contender | time | tokens/s | / local |", "|---|---:|---:|---:|"]
    for name, label in (("local", '`engine="local"`'), ("ray, 1 worker", '`engine="ray"`, 1 worker'),
                        ("ray, 2 workers", '`engine="ray"`, 2 workers')):
        ratio = wall[name] / wall["local"]
        shown = f"**{ratio:.2f}** (target <= 1.3, {'met' if ratio <= 1.3 else '**not met**'})" \
            if name == "ray, 1 worker" else f"{ratio:.2f}"
        lines.append(f"| {label} | {wall[name]:.1f} s | {tokens / wall[name]:,.0f} | {shown} |")
    lines += ["", f"Measured {when(r)}; outputs identical bytes: {r['figures']['identical_outputs']}.", "",
              "| corpus | shards | time | peak RSS |", "|---|---:|---:|---:|"]
    for scale, p in co["peaks"].items():
        lines.append(f"| {scale} ({p['rows']} windows) | {p['shards']} | {p['seconds']:.1f} s | "
                     f"{p['peak'] / 2**20:.1f} MiB |")
    lines.append(f"| 10x / 1x | | | **{co['memory']:.3f}** (target <= 1.2, {'met' if co['memory'] <= 1.2 else '**not met**'}) |")
    baseline = co["peaks"]["1x"]["baseline"] / 2**20
    lines += ["", f"Of the peak, {baseline:.0f} MiB is the interpreter and its imports."]
    return "\n".join(lines)


def attribution_table() -> str:
    """benchmarks/README.md's attribution sweep: one row per model and prompt length."""
    r = load("attribution")
    groups: dict[tuple, list[dict]] = {}
    for run in attribution_runs("embedded") + attribution_runs("random_arcee"):
        groups.setdefault((run["model"], run["seq"]), []).append(run)
    lines = ["| model | transcoders | tokens | features (nodes) | head loadings | CPU s | peak above the loaded model |",
             "|---|---|---:|---|---|---:|---:|"]
    for (model, seq), runs in groups.items():
        first = runs[0]
        tcs = (f"random TopK, {first['d_transcoder']}, k={first['k']}" if "k" in first
               else f"shipped ({first['d_transcoder']})")
        features = " / ".join(("all " if run.get("max_feature_nodes", 0) is None else "") + str(run["features"])
                              for run in runs)
        cpu_s = " / ".join(f"{run['cpu_s']:.2f}" for run in runs)
        peaks = " / ".join(f"{run['peak_increase_bytes'] / 1e9:.2f}" for run in runs)
        nodes = " / ".join(str(run["nodes"]) for run in runs)
        lines.append(f"| {model} | {tcs} | {seq} | {features} ({nodes}) | {'on' if first['head_loadings'] else 'off'} | "
                     f"{cpu_s} | {peaks} GB |")
    return "\n".join(lines + ["", f"Measured {when(r)}; one thread."])


def afm_attribution_table() -> str:
    r, f = load("attribution_afm"), afm_attribution()
    budget = f["checkpoint_bytes"] + f["transcoder_bytes"]
    lazy = f.get("lazy_transcoders", False)
    rows = [("checkpoint (synthetic, bfloat16) + 36 per-layer transcoders of 8,192 features (bfloat16"
             + (", read lazily from their files)" if lazy else ", resident)"),
             f"{f['checkpoint_bytes'] / 1e9:.2f} GB + {f['transcoder_bytes'] / 1e9:.2f} GB = {budget / 1e9:.2f} GB"),
            ("prompt; features computed (`max_feature_nodes`); nodes",
             f"{f['seq']} tokens; {f['features']} of the active; {f['nodes']:,}")]
    if f.get("head_loadings"):
        rows.append(("kept (pruned 0.8 / 0.98): nodes; edges with head loadings; QK tables",
                     f"{f['kept_nodes']:,}; {f['loading_edges']:,}; {f['qk_tables']}"))
    rows += [("resident before the call (model, transcoders, interpreter)", f"{f['rss_before_bytes'] / 1e9:.2f} GB"),
             ("peak resident during `attribute` (VmHWM)",
              f"{f['peak_rss_bytes'] / 1e9:.2f} GB = **{f['ratio']:.3f}x** checkpoint + transcoders (target <= 1.5x, "
              f"{'met' if f['ratio'] <= 1.5 else '**not met**'})"),
             ("of which above the resident before", f"{f['peak_increase_bytes'] / 1e9:.2f} GB"),
             ("time", f"{f['cpu_s']:.0f} CPU s, {f['wall_s']:.0f} s wall"
              + ("" if "phase_cpu_s" not in f else " (CPU s by phase: "
                 + ", ".join(f"{name} {sec:.0f}" for name, sec in f["phase_cpu_s"].items()) + ")"))]
    return key_value_table(rows, r)


def circuit_tracer_table() -> str:
    """The side by side with circuit-tracer: one row per case, each side at its own best batch size (and ours
    at circuit-tracer's), the peak memory of each call above the process's resident memory before it."""
    r = load("circuit_tracer_compare")
    f = r["figures"]
    lines = ["| model | tokens | features (active) | max \\|diff\\| / max \\|edge\\| | best batch: ours, circuit-tracer | "
             "hooked_models | circuit-tracer | circuit-tracer / ours | the same at circuit-tracer's batch | "
             "peak memory: ours, circuit-tracer |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in f["cases"]:
        name = c["label"] + (", our head loadings on" if c["head_loadings"] else "")
        if not c["node_sets_equal"]:
            lines.append(f"| {name} | {c['tokens']} | node sets differ ({c['shared_features']:,} of "
                         f"{c['their_features']:,} shared) | | | | | | | |")
            continue
        budget = "every one" if c["max_feature_nodes"] is None else f"{c['features']:,} computed"
        ours, theirs = c["hooked_models"], c["circuit_tracer"]
        lines.append(f"| {name} | {c['tokens']} | {budget} ({c['active']:,}) | {c['max_abs_diff_relative']:.1e} | "
                     f"{c['batch_sizes']['hooked_models']}, {c['batch_sizes']['circuit-tracer']} | {ms(ours['cpu_s'])} | "
                     f"{ms(theirs['cpu_s'])} | **{c['speed_up_cpu']:.2f}x** | {c['speed_up_cpu_same_batch']:.2f}x | "
                     f"{ours['peak_bytes'] / 1e6:,.0f} MB, {theirs['peak_bytes'] / 1e6:,.0f} MB |")
    versions = f["cases"][0]["circuit_tracer_versions"]
    loads = [x for c in f["cases"] for x in (c["load_average_before"][0], c["load_average_after"][0])]
    threads = ", ".join(f"{side} {n}" for side, n in f["threads"].items())
    swept = {(c["label"], c["tokens"]): sorted(int(b) for b in c["sweep"]["hooked_models"]) for c in f["cases"]}
    fewer = "; ".join(f"{', '.join(map(str, sizes))} only on the {label.split(' (')[0]} at {tokens} tokens"
                      for (label, tokens), sizes in swept.items() if sizes != sorted(f["batch_sizes"]))
    fewer = f" ({fewer})" if fewer else ""
    dates = sorted({run["date"][:10] for run in f.get("runs", []) if "date" in run}) or [r["date"][:10]]
    return "\n".join(lines + ["", f"Measured {' and '.join(dates)} (which cases when: `figures.runs`), load average {min(loads):.1f}-{max(loads):.1f} on "
                                   f"{r['machine']['cores']} cores (each case's before and after in the results file); "
                                   f"circuit-tracer {versions['circuit-tracer']}, nnsight {versions['nnsight']}, "
                                   f"transformers {versions['transformers']}; torch threads: {threads}; batch sizes "
                                   f"{', '.join(map(str, f['batch_sizes']))} on both sides{fewer}, interleaved {f['interleaving']}; "
                                   f"median CPU time of {f['rounds']} calls, each after an untimed gc.collect(); "
                                   f"the logits covering {f['desired_logit_prob']} of the probability, at most 10."])


def attribution_floor_table() -> str:
    """The backward-bound rows of the circuit-tracer comparison: the products each runs at the fewest as both
    tools run them (the floor), with what could still be skipped skipped (tight), ours, and every target's over
    the whole prompt; the tight and floor counts' times at this machine's best matmul rate, beside a third of
    circuit-tracer's time (the 3x target) and ours."""
    r, compared = load("attribution_floor"), load("circuit_tracer_compare")["figures"]["cases"]
    lines = ["| model | tokens | rows | products (G multiply-adds): tight, floor, ours, every target over the whole "
             "prompt | best `torch.mm` rate | tight and floor products at it | circuit-tracer / 3 | hooked_models |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["figures"]["cases"]:
        case = next(c for c in compared if (c["label"], c["tokens"], c["max_feature_nodes"], c["head_loadings"])
                    == (row["label"], row["tokens"], row["max_feature_nodes"], False))
        lines.append(f"| {row['label']} | {row['tokens']} | {row['rows']:,} | {row['tight_macs'] / 1e9:.1f}, "
                     f"{row['floor_macs'] / 1e9:.1f}, {row['ours_macs'] / 1e9:.1f}, {row['full_macs'] / 1e9:.1f} | "
                     f"{row['peak_gflops']:.0f} GFLOP/s | {ms(row['tight_s_at_peak'])}, {ms(row['floor_s_at_peak'])} | "
                     f"{ms(case['circuit_tracer']['cpu_s'] / 3)} | {ms(case['hooked_models']['cpu_s'])} |")
    return "\n".join(lines + ["", f"Counted and measured {when(r)}; one thread (`python benchmarks/attribution_floor.py`)."])


def circuit_tracer_sentence() -> str:
    cases = [c for c in load("circuit_tracer_compare")["figures"]["cases"] if c["node_sets_equal"]]
    worst = max(c["max_abs_diff_relative"] for c in cases)
    ratios = sorted(c["speed_up_cpu"] for c in cases)
    return (f"the same nodes and edges within {worst:.1e} of the largest edge, {ratios[0]:.2f}-{ratios[-1]:.2f}x "
            "circuit-tracer's speed (CPU time, each side at its best batch size)")


def transcoder_training() -> dict:
    """Training transcoders from a harvest of 1x and 10x the corpus: each run's figures and the 10x / 1x peaks."""
    f = load("transcoders")["figures"]
    return {**f, "anon": f["x10"]["peak_anon_bytes"] / f["x1"]["peak_anon_bytes"],
            "rss": f["x10"]["peak_rss_bytes"] / f["x1"]["peak_rss_bytes"]}


def transcoder_memory() -> str:
    """docs/guide/transcoders.md's Training bullet: the 10x / 1x peaks."""
    t = transcoder_training()
    return f"{t['anon']:.2f}x the peak anonymous memory; the peak RSS, {t['rss']:.2f}x"


def transcoder_training_text() -> str:
    """benchmarks/README.md's paragraph on the trainer's memory."""
    r, t = load("transcoders"), transcoder_training()
    x1, x10 = t["x1"], t["x10"]
    return (f"Over {x1['tokens']:,} and {x10['tokens']:,} tokens: peak anonymous memory "
            f"{x1['peak_anon_bytes'] / 1e6:.0f} MB and {x10['peak_anon_bytes'] / 1e6:.0f} MB (**{t['anon']:.2f}x**), "
            f"CPU {x1['cpu_s']:.2f} s and {x10['cpu_s']:.2f} s. Peak RSS (VmHWM) is "
            f"{x1['peak_rss_bytes'] / 1e6:.0f} MB and {x10['peak_rss_bytes'] / 1e6:.0f} MB ({t['rss']:.2f}x): it counts\n"
            "the file pages of the memory-mapped dataset that the random row reads brought in, page cache the kernel\n"
            f"reclaims under pressure, not memory the trainer holds. Measured {when(r)}; one thread.")


def attribution_files_table() -> str:
    """docs/guide/attribution-at-scale.md's graph files: one row per pruned graph size."""
    r = load("attribution_files")
    f = r["figures"]
    lines = ["| nodes kept (of the graph's) | model, prompt, transcoders | links | head-loaded edges | QK tables | "
             "JSON (the viewer's) | its parse | side file (safetensors) | the unpruned adjacency as JSON text |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in f["files"]:
        lines.append(f"| {row['nodes']:,} (of {row['graph_nodes']:,}) | {row['model']}, {row['seq']} tokens, "
                     f"{row['d_transcoder']:,} wide | {row['json_links']:,} | {row['loading_edges']:,} | "
                     f"{row['qk_tables']} | {row['json_bytes'] / 1e6:.2f} MB | {ms(row['json_parse_s'])} | "
                     f"{row['side_bytes'] / 1e6:.1f} MB | {row['unpruned_adjacency_as_json_bytes'] / 1e6:.0f} MB |")
    return "\n".join(lines + ["", "Random JumpReLU transcoders with skip connections; every active feature a node, "
                                   f"pruned to about each size; measured {when(r)}."])


def attribution_scale_table(name: str = "attribution_scale") -> str:
    """docs/guide/attribution-at-scale.md's scale runs (the 8 x 1024 Arcee; `attribution_alpha_er`: the
    released-size alpha-er at its block_size), head loadings and QK on."""
    r = load(name)
    f = r["figures"]
    phases = ", ".join(f"{name} {seconds:.1f}" for name, seconds in f["phase_cpu_s"].items())
    rows = [("model; transcoders", f"{f['model']}; {f['d_transcoder']:,} TopK features per layer (k {f['k']})"),
            ("prompt; features (`max_feature_nodes`); nodes", f"{f['seq']} tokens; {f['features']:,}; {f['nodes']:,}"),
            ("kept (pruned 0.8 / 0.98): nodes; edges with head loadings; QK tables",
             f"{f['kept_nodes']:,}; {f['loading_edges']:,}; {f['qk_tables']}"),
            ("time", f"{f['cpu_s']:.0f} CPU s ({phases}), {f['wall_s']:.0f} s wall"),
            ("peak resident during `attribute`", f"{f['peak_rss_bytes'] / 1e9:.2f} GB ({f['peak_increase_bytes'] / 1e9:.2f} GB "
             "above the model and transcoders)")]
    return key_value_table(rows, r)


def attribution_dataset_table() -> str:
    """docs/guide/attribution-over-a-dataset.md's and benchmarks/README.md's runs of `attribute_dataset`."""
    r = load("attribution_dataset")
    f = r["figures"]
    e, a, m = f["embedded"], f["random_arcee"], f["memory"]
    lines = ["| model, prompts | engine | wall | graphs / s | store per graph |", "|---|---|---:|---:|---:|"]
    for engine, run in e["runs"].items():
        lines.append(f"| embedded Arcee, {e['prompts']:,} IOI pairs (16 tokens, every feature: "
                     f"{e['features_graph_0']} in the first; head loadings, QK) | {engine} | {run['wall_s']:.0f} s | "
                     f"{run['graphs_per_s']:.2f} | {e['bytes_per_graph'] / 2**20:.2f} MiB |")
    lines.append(f"| random 8 x 1024 Arcee, {a['prompts']:,} random prompts of {a['seq']} tokens ({a['d_transcoder']:,} "
                 f"TopK features per layer, k {a['k']}; {a['options']['max_feature_nodes']} features a graph) | local | "
                 f"{a['wall_s']:.0f} s | {a['graphs_per_s']:.3f} | {a['bytes_per_graph'] / 2**20:.2f} MiB |")
    x1, x4 = m["1x"], m["4x"]
    same = {True: "identical bytes", False: "**not** identical", None: "not compared"}[e["identical_stores"]]
    lines += ["", f"Ray's store and the local one: {same}. Peak memory of a local run (fresh process, VmHWM): "
              f"{x1['peak_bytes'] / 2**20:.0f} MiB over {x1['prompts']} prompts, {x4['peak_bytes'] / 2**20:.0f} MiB "
              f"over {x4['prompts']} (**{m['peak_ratio_4x_over_1x']:.3f}x**). Wall clock on {threads(1)}, measured "
              f"{when(r)}; Ray's time includes its workers' start and load (2 workers on the machine's "
              f"{r['machine']['cores']} cores)."]
    return "\n".join(lines)


def explorer_load_table() -> str:
    r = load("explorer_load")
    f = r["figures"]
    rows = [(f"interactive requests ({f['requests']} from {f['clients']} clients) while a job runs: p50 / p90 / p99 / max",
             " / ".join(ms(f[k]) for k in ("p50_s", "p90_s", "p99_s", "max_s"))),
            ("the job's state when the last had answered", f["job_state_after"]),
            ("the job's batches meanwhile (it steps aside while a view runs)", f"{f['batches_during']}"),
            (f"DELETE /api/jobs/{{id}} to the job's state `cancelled`, a job of {ms(f['batch_s'])} batches", ms(f["cancel_s"])),
            (f"a circuit job (EAP-IG, 100 steps, 64 tokens) whole / DELETE to `cancelled` at {len(f['circuit_cancel_s'])} "
             "moments of its run: median, max", f"{f['circuit_job_s']:.2f} s / {f['circuit_cancel_median_s']:.2f} s, "
             f"{f['circuit_cancel_max_s']:.2f} s"),
            ("SIGTERM / SIGINT to the command line's exit, three EAP-IG jobs queued, a page polling",
             f"{f['sigterm_stop_s']:.2f} s / {f['sigint_stop_s']:.2f} s")]
    return key_value_table(rows, r)


def feature_statistics_text() -> str:
    """The one-pass statistics against a bare encode pass and `dashboard` feature by feature, and its memory."""
    r = load("features")
    f = r["figures"]
    lines = ["| transcoders | tokens | features | `statistics` CPU s | of which logits | bare encode CPU s | ratio "
             "(target <= 1.3x) | ratio without the logits | `dashboard` per feature CPU s | all dashboards / "
             "`statistics` |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, what in (("embedded", "embedded Arcee's shipped: 2 layers x 256 TopK"),
                      ("wide", "1 layer x 8,192 TopK (k=64), random 8 x 1024 Arcee")):
        g = f[key]
        lines.append(f"| {what} | {g['tokens']:,} | {g['features']:,} | {g['statistics_cpu_s']:.2f} | "
                     f"{g['logits_cpu_s']:.2f} | {g['bare_encode_cpu_s']:.2f} | **{g['ratio']:.2f}x** | "
                     f"{g['pass_ratio']:.2f}x | {g['dashboard_cpu_s_each']:.3f} | "
                     f"{g['dashboards_over_statistics']:.0f}x |")
    x1, x10 = f["memory_x1"], f["memory_x10"]
    lines.append("")
    lines.append(f"Peak anonymous memory above the loaded model over {x1['tokens']:,} and {x10['tokens']:,} tokens: "
                 f"{(x1['peak_anon_bytes'] - x1['anon_before_bytes']) / 1e6:.0f} MB and "
                 f"{(x10['peak_anon_bytes'] - x10['anon_before_bytes']) / 1e6:.0f} MB "
                 f"(**{f['peak_anon_increase_10x_over_1x']:.2f}x** for 10x the corpus)"
                 + (f"; with glibc's mmap threshold pinned at 128 KiB, "
                    f"{f['peak_anon_increase_10x_over_1x_pinned_mmap']:.2f}x" if "memory_x1_pinned_mmap" in f else "")
                 + ". The partials themselves stay about 1.5 MB a layer at both sizes, and with `malloc_trim(0)` at "
                 "every batch (a probe) the RSS is the same periodic 17-25 MB from the second shard to the last: what "
                 "is live is flat, the drift is freed memory glibc keeps. The logits (every decoder row through the "
                 "unembedding, 8,192 x 32,000 for the wide set) are a fixed cost per feature, whatever the corpus's "
                 "length: hence the ratio both ways." f" Measured {when(r)}; one thread, "
                 f"median of {f['embedded']['rounds']} interleaved rounds; the dashboards timed for "
                 f"{f['embedded']['dashboards_timed']} features and scaled to all.")
    return "\n".join(lines)


def which_tool_costs() -> str:
    """docs/which-tool.md's costs: each question's tool on the embedded models and at (or towards) AFM-4.5B's scale."""
    arcee, alpha, s8 = sweeps("patching_arcee"), sweeps("patching_alpha-er"), sweeps("patching_size_8")
    c, co, afm, a16 = circuits(), corpus(), afm_attribution(), all_features_16()
    fe = load("features")["figures"]
    shipped = {(run["model"], run["seq"]): run for run in attribution_runs("embedded")}
    afm_load = load("load_4_5b")["figures"]
    li, ho = "layer_input", "attention_head_outputs"
    pairs = load("patching_arcee")["figures"]["HookedArcee 2 x 64"]["pairs"]
    forward = (f"one AFM-4.5B-shape forward (bf16, 1 x 16 tokens, CPU) takes {afm_load['forward_s']:.0f} s, "
               f"loading it {afm_load['load_s']:.0f} s at {load_ratio():.2f}x the checkpoint's size in memory")
    rows = [
        ("What does the model predict, layer by layer?", "one cached forward (not timed alone)",
         f"8 x 1024 Arcee, 4 x 256 tokens, `run_with_cache` of every hook: "
         f"{cpu(load('forward'), 'run_with_cache', 'HookedArcee.run_with_cache'):.1f} CPU s; {forward}"),
        ("Where does the answer live?",
         f"`layer_input` by layer x position, {pairs} pairs: {ms(arcee[li]['ours'])} (Arcee), "
         f"{ms(alpha[li]['ours'])} (alpha-er)",
         f"8 x 1024 Arcee, 4 pairs x 14 positions: {s8[li]['ours']:.1f} CPU s ({s8[li]['speed_up']:.1f}x faster "
         f"than one forward per patch); AFM-4.5B not measured (its forward: the row above)"),
        ("Which heads?",
         f"heads by layer x head, {pairs} pairs: {ms(arcee[ho]['ours'])} (Arcee), {ms(alpha[ho]['ours'])} (alpha-er)",
         f"8 x 1024 Arcee: {s8[ho]['ours']:.1f} CPU s ({s8[ho]['speed_up']:.1f}x faster than one forward per patch)"),
        ("Which edges?",
         f"EAP-IG over every edge, 16 pairs: {ms(c['arcee']['ig'])} ({c['arcee']['edges']} edges, Arcee), "
         f"{ms(c['alpha_er']['ig'])} ({c['alpha_er']['edges']}, alpha-er); `edge_patch` of every edge "
         f"{ms(c['arcee']['exact'])} and {c['alpha_er']['exact']:.1f} s",
         f"4-layer, 8-head Arcee ({c['mha']['edges']} edges): EAP-IG {c['mha']['ig']:.2f} s, `edge_patch` of every "
         f"edge {c['mha']['exact']:.0f} s; AFM-4.5B not measured"),
        ("Which features?",
         f"`attribute`, 16 tokens, shipped transcoders: {shipped[('embedded arcee', 16)]['cpu_s']:.2f} CPU s "
         f"({shipped[('embedded arcee', 16)]['nodes']} nodes, Arcee), {shipped[('embedded alpha_er', 16)]['cpu_s']:.2f} "
         f"s ({shipped[('embedded alpha_er', 16)]['nodes']}, alpha-er)",
         f"AFM-4.5B's shape, 36 transcoders of {afm['d_transcoder']:,} features, {afm['seq']} tokens, "
         f"{afm['features']} features computed: {afm['cpu_s']:.0f} CPU s, {afm['wall_s'] / 60:.1f} min wall, peak "
         f"{afm['ratio']:.2f}x checkpoint + transcoders (8 x 1024 Arcee, every feature of 16 tokens: "
         f"{a16['cpu_s']:.1f} CPU s)"),
        ("What does this feature do?",
         f"`features.statistics` of every feature of the shipped transcoders ({fe['embedded']['features']:,}) over "
         f"{fe['embedded']['tokens']:,} tokens: {fe['embedded']['statistics_cpu_s']:.2f} CPU s, where a dashboard for "
         f"each would take {fe['embedded']['dashboards_over_statistics']:.0f}x as long; a harvest, if you keep one: "
         f"{co['tokens'] / co['wall']['local']:,.0f} tokens/s on a 4-layer, 256-wide Arcee (wall clock), memory "
         f"flat in the corpus ({co['memory']:.2f}x for 10x)",
         f"1 layer x {fe['wide']['features']:,} features of an 8 x 1024 Arcee over {fe['wide']['tokens']:,} tokens: "
         f"{fe['wide']['statistics_cpu_s']:.1f} CPU s (dashboards: {fe['wide']['dashboards_over_statistics']:.0f}x); "
         f"AFM-4.5B not measured; `engine=\"ray\"` spreads the work over workers ({co['ray1']:.2f}x local's time "
         f"with 1 worker, for a harvest)"),
    ]
    lines = ["| question | on the embedded models | at scale |", "|---|---|---|"]
    return "\n".join(lines + [f"| {q} | {small} | {large} |" for q, small, large in rows])


# ----------------------------------------------------------------------- training at AFM-4.5B's shape
def gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def threads(n: int) -> str:
    return "one thread" if n == 1 else f"{n} threads"


def layer_ranges(calls: list[int]) -> str:
    """The layers whose forward ran, as ranges ("0-3")."""
    ran = [i for i, c in enumerate(calls) if c]
    return f"{ran[0]}-{ran[-1]}" if ran == list(range(ran[0], ran[-1] + 1)) else ", ".join(map(str, ran))


def afm_training() -> dict:
    """The one-process streamed run: its figures, and its training peak over checkpoint + parameters + Adam."""
    f = load("train_transcoders_afm")["figures"]
    (rank,), (shard,) = f["ranks"], f["shards"]
    state = shard["parameter_bytes"] + shard["adam_bytes"]
    return {**f, "rank": rank, "state": state, "budget": f["checkpoint_bytes"] + state,
            "ratio": rank["after"]["peak_rss"] / (f["checkpoint_bytes"] + state)}


def afm_training_table() -> str:
    """docs/guide/training-at-scale.md's one-layer run."""
    r, t = load("train_transcoders_afm"), afm_training()
    rank, (shard,), n = t["rank"], t["shards"], len(t["rank"]["layer_forward_calls"])
    predicted = load("train_transcoders_afm_plan")["figures"]["measured_runs_predicted"]["single"]
    rest = rank["cpu_s"] - rank["forward_cpu_s"]
    rows = [
        ("transcoder", f"layer {t['layer']}, TopK, {t['width']:,} features, k {t['k']}"),
        ("data", f"{t['steps']} steps of {t['batch_tokens']} tokens ({t['steps'] * t['batch_tokens']:,} tokens of "
                 f"random ids in windows of {t['seq']}), shuffling buffer of {t['buffer_tokens']:,} tokens"),
        ("layers the model ran (forward hooks that fired)",
         f"{layer_ranges(rank['layer_forward_calls'])} of 0-{n - 1}"),
        ("checkpoint; transcoder parameters + Adam state (its checkpoint file)",
         f"{gb(t['checkpoint_bytes'])}; {gb(shard['parameter_bytes'])} + {gb(shard['adam_bytes'])}"),
        ("peak resident while training (VmHWM, reset after loading)",
         f"{gb(rank['after']['peak_rss'])} = **{t['ratio']:.3f}x** checkpoint + parameters + Adam"),
        ("of which file pages (RssFile: the checkpoint's, mapped) / anonymous (peak RssAnon, sampled)",
         f"{gb(rank['after']['file'])} / {gb(rank['peak_anon'])}"),
        ("anonymous: before training (interpreter, libraries) / the peak above it",
         f"{gb(rank['before_training']['anon'])} / {gb(rank['peak_anon'] - rank['before_training']['anon'])}"),
        ("the plan's arithmetic for the run: parameters, gradients, Adam, batch and the step's tensors; the "
         "buffer (its refills peak higher: below)", f"{gb(predicted['device_total'])}; {gb(predicted['buffer_host'])}"),
        ("peak resident while loading, before training", gb(rank["loaded"]["peak_rss"])),
        ("CPU: the model's forwards", f"{rank['forward_cpu_s']:.0f} s for {rank['forward_tokens']:,} tokens "
                                      f"({rank['forward_cpu_s'] / rank['forward_tokens'] * 1e3:.1f} ms a token)"),
        ("CPU: the rest (the transcoder's steps)", f"{rest:.0f} s, {rest / t['steps']:.2f} s a step"),
        ("FVU of the training batch: first logged, last; L0",
         f"{t['fvu_first'][0]:.3f} (after {t['curve_tokens'][0]:,} tokens), {t['fvu_final'][0]:.3f}; "
         f"{t['l0_final'][0]:.0f}"),
    ]
    return key_value_table(rows, r) + (f" {threads(rank['torch_threads']).capitalize()}; "
                                       f"{rank['cpu_s'] + rank['loaded']['cpu_s']:.0f} CPU s with the loading.")


def afm_sharded_table() -> str:
    """docs/guide/training-at-scale.md's feature-sharded cross-layer run: one row per process."""
    r = load("train_transcoders_afm_sharded")
    f = r["figures"]
    predicted = load("train_transcoders_afm_plan")["figures"]["measured_runs_predicted"]["sharded"]
    whole = sharded_whole()
    lines = ["| process | parameters (share of the whole) | Adam state | anonymous: peak while training (sampled) | "
             "anonymous: at the last step, after the final gather | resident peak (VmHWM) | the checkpoint's pages "
             "shared with the other process (Shared_Clean); proportional share of all (PSS) | the model's forwards | "
             "CPU s |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rank, shard in zip(f["ranks"], f["shards"], strict=True):
        last = rank["steps"][-1]
        shared = max(rank["steps"], key=lambda step: step["shared_clean"])  # before the kernel reclaimed any
        lines.append(f"| {rank['rank']} | {gb(shard['parameter_bytes'])} ({shard['parameter_bytes'] / whole:.4f}) | "
                     f"{gb(shard['adam_bytes'])} | {gb(rank['peak_anon'])} | {gb(last['anon'])}, "
                     f"{gb(rank['after']['anon'])} | {gb(rank['after']['peak_rss'])} | {gb(shared['shared_clean'])}; "
                     f"{gb(shared['pss'])} | {rank['forward_tokens']:,} tokens, layers "
                     f"{layer_ranges(rank['layer_forward_calls'])} | {rank['cpu_s']:.0f} |")
    lines += ["", f"A cross-layer transcoder of {f['width']} TopK features per layer (k {f['k']}, "
                  f"{gb(whole)} of parameters), `layout=\"features\"` over {f['processes']} gloo processes, "
                  f"{f['steps']} steps of {f['batch_tokens']} tokens (random ids, windows of {f['seq']}, buffer "
                  f"{f['buffer_tokens']} tokens); the checkpoint ({gb(f['checkpoint_bytes'])}) memory-mapped in both. "
                  f"Predicted per process: {gb(predicted['device_total'])} to train (parameters, gradients, Adam, the "
                  f"gathered batch, the step's activations), {gb(predicted['gathered_at_end'])} more for the final "
                  f"gather. FVU of the last batch, by layer: {min(f['fvu_final']):.3f} to {max(f['fvu_final']):.3f}. "
                  f"Measured {when(r)}; {threads(f['ranks'][0]['torch_threads'])} a process."]
    return "\n".join(lines)


def sharded_whole() -> int:
    """The sharded run's whole cross-layer transcoder's parameter bytes (what the final gather returned)."""
    return load("train_transcoders_afm_sharded")["figures"]["ranks"][0]["result_parameter_bytes"]


def streaming_buffer_sentence() -> str:
    """docs/guide/training-at-scale.md: the streaming buffer's peak and held memory against its size."""
    f = load("streaming_buffer")["figures"]
    return (f"a {gb(f['nominal_bytes'])} buffer ({f['buffer_tokens']:,} tokens) peaks at "
            f"**{f['peak_over_nominal']:.2f}x** its size, and holds {f['held_over_nominal']:.2f}x between refills")


def afm_plan() -> dict:
    return load("train_transcoders_afm_plan")["figures"]


def afm_plan_sizes() -> str:
    """docs/guide/training-at-scale.md's full-size parameter and activation figures."""
    p = afm_plan()
    n, d, f = p["layers"], p["hidden_size"], p["features"]
    one, clt = p["per_layer"], p["cross_layer"]
    io = p["mlp_io_bytes_per_token"]
    rows = [
        (f"one layer's transcoder: W_enc [{d} {f}], b_enc, W_dec [{f} {d}], b_dec",
         f"{one['parameters'] / 1e6:,.1f} M", gb(4 * one["parameters"]), gb(8 * one["trained"]),
         gb(4 * one["trained"])),
        (f"{n} per-layer transcoders", f"{n * one['parameters'] / 1e9:,.2f} B", gb(4 * n * one["parameters"]),
         gb(8 * n * one["trained"]), gb(4 * n * one["trained"])),
        (f"cross-layer transcoder: {n} encoders [{d} {f}]", f"{clt['encoder'] / 1e9:,.2f} B", gb(4 * clt["encoder"]),
         "", ""),
        (f"its decoders: layer l writes layers l ... {n - 1}, {n * (n + 1) // 2} blocks [{f} {d}] (layer 0's: "
         f"[{f} {n} {d}])", f"{clt['decoder'] / 1e9:,.2f} B", gb(4 * clt["decoder"]), "", ""),
        ("the whole cross-layer transcoder (with biases)", f"{clt['parameters'] / 1e9:,.2f} B",
         gb(4 * clt["parameters"]), gb(8 * clt["trained"]), gb(4 * clt["trained"])),
    ]
    lines = ["| | parameters | float32 | Adam state (2x) | gradients |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {c} | {e} | {g} |" for a, b, c, e, g in rows]
    saved = p["saved_bytes_per_token_feature"]
    lines += ["", "| per token | bytes |", "|---|---:|",
              f"| MLP input + output of one layer, bfloat16 (the model's, the buffer's) / float32 (the batch's) | "
              f"{io['bfloat16'] // n:,} / {io['float32'] // n:,} |",
              f"| the same for all {n} layers (a cross-layer transcoder's) | {io['bfloat16']:,} / {io['float32']:,} |",
              f"| a harvest of all {n} layers on disk (`corpus.harvest` stores bfloat16 as float32) | "
              f"{io['float32']:,} |",
              f"| kept for backward by the loss, per feature of each layer (pre-activations, activations, the TopK "
              f"mask: measured on `batch_loss`); their gradients while backward runs | {saved['per_layer']:g}; "
              f"{p['backward_gradient_bytes_per_token_feature']:g} |",
              f"| the shuffling buffer of {p['buffer_tokens']:,} tokens, one layer / all {n} | "
              f"{gb(p['buffer_tokens'] * io['bfloat16'] // n)} / {gb(p['buffer_tokens'] * io['bfloat16'])} |"]
    return "\n".join(lines)


def afm_plan_layouts() -> str:
    """docs/guide/training-at-scale.md's GPUs per layout, from the plan's arithmetic."""
    r, p = load("train_transcoders_afm_plan"), afm_plan()
    n, lay = p["layers"], p["layouts"]
    budget = p["gpu_bytes"] * p["usable_fraction"]

    def cells(b):
        return (f"{gb(b['model'])} | {gb(b['parameters'] + b['gradients'] + b['adam'])} | {gb(b['batch'])} | "
                f"{gb(b['step_activations'])} | **{gb(b['device_total'])}** | {gb(b['buffer_host'])} | "
                f"{gb(b['gather_device_peak'])}; {gb(b['gathered_at_end'])}")

    rows = [
        (f"per-layer, `layout=\"data\"`, a process to a GPU training {lay['per_layer_data']['layers_per_gpu']} "
         "layers (`layers=(l, ...)`)", cells(lay["per_layer_data"]["bytes"]),
         f"{lay['per_layer_data']['gpus']} ({n} layers)"),
        (f"per-layer, all {n} layers, `layout=\"features\"`", cells(lay["per_layer_features"]["bytes"]),
         str(lay["per_layer_features"]["gpus"])),
        ("cross-layer, `layout=\"features\"`", cells(lay["cross_layer_features"]["bytes"]),
         str(lay["cross_layer_features"]["gpus"])),
        ("cross-layer, `layout=\"data\"` (the whole transcoder in every process)",
         cells(lay["cross_layer_data"]["bytes"]), str(lay["cross_layer_data"]["gpus"] or "none fits")),
    ]
    lines = ["| layout | model (bf16) | parameters + gradients + Adam | batch (fp32) | step activations | "
             "on the GPU | buffer (host) | the final gather: on the GPU; the result (host) | 80 GB GPUs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines + ["", f"Per process, one process to a GPU; a GPU holds {gb(budget)} "
                                   f"({p['usable_fraction']:.0%} of {p['gpu_bytes'] / 2**30:.0f} GiB); batches of "
                                   f"{p['batch_tokens']:,} tokens. Computed {r['date'][:10]} by "
                                   f"`{r['command']}`."])


# ----------------------------------------------------------------------------- side by side with sparsify
def sparsify_comparison() -> dict:
    """benchmarks/results/transcoder_training.json's figures: the runs, their summaries (mean and sd over
    seeds) per setting, and the target comparison (ours against sparsify's best Adam setting)."""
    return load("transcoder_training")["figures"]


def plus_minus(stat: dict, digits: int) -> str:
    """`mean ± sd` (just the mean where one seed ran)."""
    return f"{stat['mean']:.{digits}f}" + (f" ± {stat['sd']:.{digits}f}" if stat["sd"] is not None else "")


def sparsify_ratios() -> str:
    """Ours over sparsify's best Adam setting: FVU per layer; CPU time per token (means over seeds)."""
    f = sparsify_comparison()
    ours, theirs = f["summary"][f["our_best"]], f["summary"][f["sparsify_best_adam"]]
    fvu = " / ".join(f"{o['mean'] / t['mean']:.2f}" for o, t in zip(ours["fvu"], theirs["fvu"]))
    return f"{fvu}; {ours['cpu_s_per_1k_tokens']['mean'] / theirs['cpu_s_per_1k_tokens']['mean']:.2f}"


def sparsify_targets(f: dict) -> list[tuple[str, bool]]:
    """The issue's targets for our transcoders (at our tuned lr) against sparsify's best Adam setting, at the same
    k: (what, met)."""
    ours, theirs = f["summary"][f["our_best"]], f["summary"][f["sparsify_best_adam"]]
    fvu = [o["mean"] <= t["mean"] for o, t in zip(ours["fvu"], theirs["fvu"])]
    return [("FVU at most its on every layer", all(fvu)),
            ("loss recovered at least its", ours["loss_recovered"]["mean"] >= theirs["loss_recovered"]["mean"]),
            ("dead % at most its" + ("" if len({o["mean"] <= t["mean"] for o, t in zip(ours["dead_pct"], theirs["dead_pct"])})
                                      == 1 else " (" + ", ".join(
                f"layer {l} {'met' if o['mean'] <= t['mean'] else 'not'}" for l, (o, t) in
                enumerate(zip(ours["dead_pct"], theirs["dead_pct"]))) + ")"),
             all(o["mean"] <= t["mean"] for o, t in zip(ours["dead_pct"], theirs["dead_pct"]))),
            ("CPU time per token at most its",
             ours["cpu_s_per_1k_tokens"]["mean"] <= theirs["cpu_s_per_1k_tokens"]["mean"])]


def sparsify_verdict() -> str:
    """The guide's sentence: ours at its tuned setting against sparsify's best Adam setting, figure by figure
    (means over seeds), and which targets are met."""
    f = sparsify_comparison()
    ours, theirs = f["summary"][f["our_best"]], f["summary"][f["sparsify_best_adam"]]

    def pair(key: str, digits: int) -> str:
        if isinstance(ours[key], list):
            return (" / ".join(f"{v['mean']:.{digits}f}" for v in ours[key]) + " against "
                    + " / ".join(f"{v['mean']:.{digits}f}" for v in theirs[key]))
        return f"{ours[key]['mean']:.{digits}f} against {theirs[key]['mean']:.{digits}f}"

    def close(key: str, name: str) -> list[str]:  # the figures whose means differ by less than either's sd
        pairs = zip(ours[key], theirs[key]) if isinstance(ours[key], list) else [(ours[key], theirs[key])]
        found = [(l, o, t) for l, (o, t) in enumerate(pairs)
                 if abs(o["mean"] - t["mean"]) < max(o["sd"] or 0, t["sd"] or 0)]
        return [name + (f", layer {l}" if isinstance(ours[key], list) else "") for l, o, t in found]

    missed = [what for what, met in sparsify_targets(f) if not met]
    near = [*close("fvu", "FVU"), *close("dead_pct", "dead %"), *close("loss_recovered", "loss recovered"),
            *close("cpu_s_per_1k_tokens", "CPU time")]
    seeds = ", ".join(map(str, ours["seeds"]))
    return (f"ours at its tuned setting ({f['our_best']}) against sparsify's best Adam setting "
            f"({f['sparsify_best_adam']}), means over seeds {seeds}: FVU per layer {pair('fvu', 6)}, L0 "
            f"{pair('l0', 1)}, dead % {pair('dead_pct', 1)}, loss recovered {pair('loss_recovered', 5)}, KL "
            f"{pair('kl_divergence', 5)}, CPU s per 1k tokens {pair('cpu_s_per_1k_tokens', 4)}; "
            + ("every target met" if not missed else "not met: " + "; ".join(missed))
            + (f" ({', '.join(near)}: the two means closer than either side's sd over the seeds)" if near else ""))


def sparsify_table() -> str:
    """benchmarks/README.md's side-by-side with sparsify: one row per sparsify setting and ours (k=16), the
    targets, the k sweep."""
    r = load("transcoder_training")
    f = r["figures"]
    layers = len(f["recipe"]["hookpoints"])
    head = ("| side | setting | " + " | ".join(f"FVU, layer {l}" for l in range(layers))
            + " | L0, layer 0 / 1 | dead %, layer 0 / 1 | loss recovered | KL | CPU s / 1k tokens |")
    lines = [head, "|---|---|" + "---:|" * (layers + 5)]
    version = f["sparsify_versions"]["eai-sparsify"]
    for name, s in f["summary"].items():
        side = "hooked_models" if name in f["our_settings"] else f"sparsify {version}"
        setting = name
        if name in (f["sparsify_best"], f["our_best"]):
            setting += " (its best)" if name == f["sparsify_best"] else " (tuned)"
        lines.append(f"| {side} | {setting} | " + " | ".join(plus_minus(v, 5) for v in s["fvu"])
                     + " | " + " / ".join(f"{v['mean']:.1f}" for v in s["l0"]) + " | "
                     + " / ".join(plus_minus(v, 1) for v in s["dead_pct"])
                     + f" | {plus_minus(s['loss_recovered'], 5)} | {plus_minus(s['kl_divergence'], 5)} | "
                     + f"{plus_minus(s['cpu_s_per_1k_tokens'], 4)} |")
    targets = "; ".join(f"{what} {'met' if met else '**not met**'}" for what, met in sparsify_targets(f))
    every_run = f["runs"] + f["tuning"]["runs"] + f["sweep"]["runs"]
    conversion = max(r["fvu_conversion_rel_diff"] for r in every_run if r["side"] == "sparsify")
    seeds = f["summary"][f["our_best"]]["seeds"]
    lines += ["", f"Targets, ours at its tuned lr against sparsify's best Adam setting ({f['sparsify_best_adam']}): "
              f"{targets}. The cross-layer transcoder keeps k per layer, the per-layer pair's total L0. "
              f"Mean ± sd over seeds {', '.join(map(str, seeds))}; measured {when(r)}; sparsify "
              f"{version}, schedulefree {f['sparsify_versions']['schedulefree']}, transformers "
              f"{f['sparsify_versions']['transformers']}; one thread. sparsify's transcoders converted into ours score "
              f"its own FVU within {conversion:.0e} (relative, every run). KL: the replacement model's next-token "
              "distributions from the model's, per position."]
    tuning = "; ".join(f"{r['setting']}: FVU {' / '.join(f'{v:.5f}' for v in r['fvu'])}, L0 "
                       f"{' / '.join(f'{v:.1f}' for v in r['l0'])}, dead % {' / '.join(f'{v:.1f}' for v in r['dead_pct'])}"
                       for r in f["tuning"]["runs"])
    if tuning:
        rule = f["tuning"].get("our_rule")
        lines += ["", f"Learning rates tuned on seed {f['tuning']['seed']} (held-out FVU per layer; the lowest "
                  "geometric mean over layers chosen" + (f"; ours: {rule}" if rule else "")
                  + f"; sides interleaved lr by lr where both were tuned): {tuning}."]
    if not any(r["side"] == "sparsify" for r in f["tuning"]["runs"]):
        lines += ["", "sparsify's Adam lr was given (`--adam-lr`, the command above), not tuned in this run: "
                  "the lr its own sweep over 2e-3 ... 3.2e-2 chose on this recipe, seed and data (`python "
                  "benchmarks/transcoder_training.py --threads 1` runs that sweep and every sparsify setting)."]
    sweep = f["sweep"]
    lines += ["", f"The k sweep (sparsify: {sweep['setting']}; ours: {f['our_best']}; seeds {', '.join(map(str, sweep['seeds']))}; mean over "
              "seeds where more than one), held-out L0 and FVU per layer:", "",
              "| k | sparsify L0 | sparsify FVU | hooked_models L0 | hooked_models FVU |", "|---:|---:|---:|---:|---:|"]
    points = sweep_points()
    for i, k in enumerate(sweep["ks"]):
        cells = []
        for side in ("sparsify", "ours"):
            at = [points[side][l][i] for l in range(layers)]
            cells += [" / ".join(f"{p['l0']:.1f}" for p in at), " / ".join(f"{p['fvu']:.5f}" for p in at)]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_points() -> dict:
    """The k sweep as drawn: {side: [per layer: [{"k", "l0", "fvu", "fvu_sd"} per k]]}, means over seeds."""
    sweep = sparsify_comparison()["sweep"]
    layers = len(sweep["runs"][0]["fvu"])
    out = {}
    for side in ("sparsify", "ours"):
        out[side] = []
        for l in range(layers):
            row = []
            for k in sweep["ks"]:
                runs = [r for r in sweep["runs"] if r["side"] == side and r["k"] == k]
                fvu = [r["fvu"][l] for r in runs]
                row.append({"k": k, "l0": round(sum(r["l0"][l] for r in runs) / len(runs), 6),
                            "fvu": round(sum(fvu) / len(fvu), 9),
                            "fvu_sd": round(statistics.stdev(fvu), 9) if len(fvu) > 1 else 0.0})
            out[side].append(row)
    return out


def draw_fvu_l0(path: Path, points: dict) -> None:
    """FVU against L0, one panel per layer, both sides' k sweeps."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = sparsify_comparison()
    labels = {"sparsify": f"sparsify {f['sparsify_versions']['eai-sparsify']} ({f['sweep']['setting']})",
              "ours": "hooked_models train_transcoders"}
    layers = len(points["ours"])
    fig, axes = plt.subplots(1, layers, figsize=(4.2 * layers, 3.6), squeeze=False)
    for l, ax in enumerate(axes[0]):
        for side, marker in (("sparsify", "s"), ("ours", "o")):
            row = points[side][l]
            ax.errorbar([p["l0"] for p in row], [p["fvu"] for p in row], yerr=[p["fvu_sd"] for p in row],
                        marker=marker, capsize=3, label=labels[side])
            for p in row:
                ax.annotate(f"k={p['k']}", (p["l0"], p["fvu"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_yscale("log")
        ax.set_xlabel("L0 (held-out tokens)")
        ax.set_ylabel("FVU (held out)")
        ax.set_title(f"layer {l} MLP, {f['recipe']['d_transcoder']} features")
        ax.grid(True, which="both", alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    # The plotted numbers ride in the file: the check compares them, not pixels (fonts differ between machines).
    fig.savefig(path, dpi=110, metadata={"Software": None, "Source": json.dumps(points, sort_keys=True)})
    plt.close(fig)


# Images drawn from the results: (file, what it plots, how it is drawn).
IMAGES = {
    "transcoder-training-fvu-l0": (ROOT / "docs" / "guide" / "img" / "transcoder-training-fvu-l0.png",
                                   sweep_points, draw_fvu_l0),
}


def drawn_from(path: Path) -> object:
    """The numbers an image was drawn from (its PNG text chunk "Source"), or None."""
    from PIL import Image

    if not path.is_file():
        return None
    with Image.open(path) as image:
        source = image.text.get("Source")
    return None if source is None else json.loads(source)


PARTS = {
    "features": feature_statistics_text,
    "speed-table": speed_table,
    "speed-measured": measured,
    "summary": summary_table,
    "forward": forward_table,
    "forward-overhead": overhead_table,
    "patching": patching_table,
    "load": load_table,
    "load-ratio": lambda: f"{load_ratio():.2f}x",
    "circuits": circuits_table,
    "circuits-sentence": circuits_sentence,
    "corpus": corpus_tables,
    "corpus-memory": lambda: f"{corpus()['memory']:.3f}x",
    "attribution": attribution_table,
    "attribution-afm": afm_attribution_table,
    "attribution-afm-ratio": lambda: f"{afm_attribution()['ratio']:.3f}x",
    "circuit-tracer": circuit_tracer_table,
    "transcoders": transcoder_training_text,
    "transcoders-memory": transcoder_memory,
    "circuit-tracer-sentence": circuit_tracer_sentence,
    "attribution-floor": attribution_floor_table,
    "attribution-files": attribution_files_table,
    "attribution-scale": attribution_scale_table,
    "attribution-alpha-er": lambda: attribution_scale_table("attribution_alpha_er"),
    "explorer-load": explorer_load_table,
    "attribution-dataset": attribution_dataset_table,
    "training-afm": afm_training_table,
    "training-afm-sharded": afm_sharded_table,
    "training-plan-sizes": afm_plan_sizes,
    "training-plan-layouts": afm_plan_layouts,
    "training-buffer": streaming_buffer_sentence,
    "training-plan-harvest": lambda: f"{100e6 * afm_plan()['mlp_io_bytes_per_token']['float32'] / 1e12:.0f} TB",
    "transcoder-training": sparsify_table,
    "transcoder-training-verdict": sparsify_verdict,
    "which-tool": which_tool_costs,
}


def render(text: str) -> str:
    """`text` with every generated part rendered from the results (a block keeps its line breaks around)."""

    def part(match: re.Match) -> str:
        name, body = match["name"], match["body"]
        if name not in PARTS:
            raise KeyError(f"unknown figures part {name!r}; known: {', '.join(PARTS)}")
        block = body.startswith("\n")
        rendered = "\n".join(line if line.startswith("|") or len(line) <= 110 else
                             textwrap.fill(line, 110, break_on_hyphens=False) for line in PARTS[name]().split("\n"))
        return f"<!-- figures: {name} -->" + (f"\n{rendered}\n" if block else rendered) + "<!-- /figures -->"

    return PART.sub(part, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a part is stale")
    args = parser.parse_args()
    stale = []
    for document in DOCUMENTS:
        text = document.read_text()
        new = render(text)
        if new != text:
            stale.append(document.relative_to(ROOT))
            if not args.check:
                document.write_text(new)
    for path, data, draw in IMAGES.values():
        points = data()
        if drawn_from(path) != points:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                draw(path, points)
    if args.check and stale:
        sys.exit(f"stale benchmark figures in {', '.join(map(str, stale))}: run python benchmarks/figures.py")
    print(("stale: " if args.check else "rewrote: ") + ", ".join(map(str, stale)) if stale else "up to date")


if __name__ == "__main__":
    main()
