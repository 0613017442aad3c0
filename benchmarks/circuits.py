"""Every edge's score: EAP-IG and EAP (hooked_models.circuits) against exact edge patching edge by edge, and
against TransformerLens's attribution_patch at edge granularity on multi-head attention.

    python benchmarks/circuits.py --threads 1                  # embedded IOI models + a multi-head Arcee
    python benchmarks/circuits.py --threads 1 --prompts 32 --steps 10 --rounds 5

Per model, on the same prompts and metric: `edge_attribution(method="eap-ig")` (one batched forward and
backward over the steps), `edge_attribution(method="eap")` (clean forward, corrupted forward, one backward),
`edge_patch` of every edge alone (the exact effects, batched over edge sets), and, where TransformerLens
accepts the model (multi-head attention: alpha-er, and an Arcee with as many key/value heads as query heads),
`transformer_lens.tools.analysis.attribution_patching.attribution_patch` at edge granularity (one forward and
backward per prompt pair, per-position edges). Our EAP and TransformerLens's are checked to agree first.
CPU time in interleaved rounds (benchmarks/common.py); ratios against our EAP-IG; written to
benchmarks/results/circuits.json. Not a test: timings belong here, never in an assertion.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Results, interleaved, randomize_, report, timings  # noqa: E402
from hooked_models import HookedAlphaEr, HookedArcee, circuits  # noqa: E402
from hooked_models.embedded.task import make_ioi_prompts  # noqa: E402


def tl_edge_attribution():
    try:
        from transformer_lens.tools.analysis import attribution_patching as tl
        tl.EdgeAttributionConfig(granularity="edge")
    except (ImportError, NotImplementedError):
        return None
    return tl


def mha_arcee(layers: int, heads: int, head_dim: int, vocab: int) -> HookedArcee:
    from transformers import ArceeConfig, ArceeForCausalLM

    config = ArceeConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=4 * heads * head_dim,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=head_dim, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    torch.manual_seed(0)
    return HookedArcee.from_hf(randomize_(ArceeForCausalLM(config))).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="IOI prompt pairs (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="EAP-IG steps (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--mha-layers", type=int, default=4, help="the multi-head Arcee's shape")
    parser.add_argument("--mha-heads", type=int, default=8)
    parser.add_argument("--results", default="circuits",
                        help="write the figures to benchmarks/results/RESULTS.json (default: %(default)s)")
    args = parser.parse_args()
    record = Results(args.results)
    figures = {"prompts": args.prompts, "steps": args.steps, "rounds": args.rounds, "models": {}}
    if args.threads:
        torch.set_num_threads(args.threads)
    tl = tl_edge_attribution()
    pairs = make_ioi_prompts(args.prompts, seed=0)
    clean, corrupted = pairs.clean_tokens, pairs.corrupted_tokens
    # One answer pair for every prompt: TransformerLens hands its metric one prompt's logits with no index.
    correct, incorrect = int(pairs.correct[0]), int(pairs.incorrect[0])

    def metric(logits):
        return (logits[:, -1, correct] - logits[:, -1, incorrect]).mean()

    models = {"HookedArcee embedded (GQA 4/2 heads, 2 layers)": HookedArcee.from_pretrained("embedded"),
              "HookedAlphaEr embedded (MHA 4 heads, 2 layers)": HookedAlphaEr.from_pretrained("embedded"),
              f"HookedArcee random (MHA {args.mha_heads} heads, {args.mha_layers} layers)":
                  mha_arcee(args.mha_layers, args.mha_heads, 16, clean.max().item() + 1)}
    print(f"{args.prompts} IOI prompt pairs x {clean.shape[1]} tokens; EAP-IG with {args.steps} steps; "
          f"{torch.get_num_threads()} threads; TransformerLens edge attribution: {'yes' if tl else 'absent'}")
    for label, model in models.items():
        edges = circuits.graph(model).edges
        run = (model, clean, corrupted, metric)
        contenders = {
            f"circuits EAP-IG ({args.steps} steps)": lambda: circuits.edge_attribution(*run, "eap-ig", args.steps),
            "circuits EAP": lambda: circuits.edge_attribution(*run, "eap"),
            "circuits edge_patch, every edge": lambda: circuits.edge_patch(*run, [[e] for e in edges]),
        }
        mha = model.cfg.n_key_value_heads == model.cfg.n_heads
        if tl is not None and mha:
            config = tl.EdgeAttributionConfig(granularity="edge")
            contenders["TransformerLens attribution_patch, edge"] = (
                lambda: tl.attribution_patch(model, corrupted, clean, metric, config))
            theirs = contenders["TransformerLens attribution_patch, edge"]().edge_scores
            ours = circuits.edge_attribution(*run, "eap")
            summed = circuits.Graph.from_transformer_lens(model, theirs, clean.shape[1])
            assert summed.edges == ours.edges
            torch.testing.assert_close(ours.scores, summed.scores, rtol=1e-3, atol=1e-3)
            print(f"\n{label}: {len(edges)} edges ({len(theirs)} per-position edges in TransformerLens); "
                  "our EAP equals TransformerLens's, summed over positions")
        else:
            print(f"\n{label}: {len(edges)} edges" + ("" if mha else "; TransformerLens refuses GQA at edge granularity"))
        medians = interleaved(contenders, args.rounds)
        report(label, medians, baseline=next(iter(contenders)))
        figures["models"][label] = {"edges": len(edges), **timings(medians)}
        cpu = {name: c for name, (c, _) in medians.items()}
        ig, eap, exact = (cpu[name] for name in list(contenders)[:3])
        print(f"  every edge exactly (edge_patch) / EAP-IG: {exact / ig:.1f}x")
        if "TransformerLens attribution_patch, edge" in cpu:
            theirs = cpu["TransformerLens attribution_patch, edge"]
            print(f"  TransformerLens edge EAP / our EAP: {theirs / eap:.1f}x;  / our EAP-IG: {theirs / ig:.1f}x")
    record.save(figures)


if __name__ == "__main__":
    main()
