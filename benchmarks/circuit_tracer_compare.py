"""Side by side with circuit-tracer: the same attribution graph on Arcee models, and the time ratio.

    python benchmarks/circuit_tracer_compare.py --threads 1          # needs .ci/ct-env (see below)

circuit-tracer (0.5.0) cannot share an environment with this package (its nnsight backend needs
transformers <= 4.57.3, this package >= 5), so the script runs in two halves:
- `--side` runs in the side environment .ci/ct-env (torch 2.13 CPU, transformers 4.57, circuit-tracer
  0.5.0 from PyPI: `bash .ci/ct-env.sh` builds it). It imports nothing of this package: it loads the
  model from its directory with circuit-tracer's `NNSightReplacementModel`, Llama's nnsight
  mapping registered for `ArceeForCausalLM` (Arcee is Llama with another MLP: the same module paths, the
  same RMSNorm and eager attention source), loads the transcoders with its own `load_transcoder_set`,
  times `attribute` and saves the adjacency, the nodes and the timing to a .pt file.
- The main half (this environment) writes the transcoders (and, for the second model, the checkpoint),
  starts the side half, computes `hooked_models.attribution.attribute` on the same tokens, compares,
  and writes benchmarks/results/circuit_tracer_compare.json.

Models: the embedded Arcee (transcoders 256 and 1024 wide), and a random 8-layer, 1024-wide GQA Arcee
over the embedded tokenizer (`--random-width` features, 4096; 0 skips it), written by
`save_arcee_checkpoint`, which transformers 4.57 reads. Transcoders: random per-layer JumpReLU
transcoders with skip connections and non-zero biases, written by `TranscoderSet.save` (circuit-tracer's
layout). Not the shipped TopK ones: circuit-tracer's file loader (`load_relu_transcoder`) knows ReLU and JumpReLU only (a `k` tensor fails its strict
`load_state_dict`), and its `TopK` keeps negative pre-activations where ours (`topk_relu`) zeroes them.

Conventions reconciled (each checked by the comparison, not assumed):
- Hook names: our config.yaml names our vocabulary (`mlp_input`, `mlp.mlp_output`); circuit-tracer's
  nnsight mapping knows TransformerLens names: the side half passes `mlp.hook_in` / `mlp.hook_out`
  (Llama's mapping: post_attention_layernorm's output / the mlp's output: the same two tensors).
- Position 0: circuit-tracer zeroes every feature and the error at position 0 (`zero_positions`, for
  the BOS it prepends); we keep them as nodes. Our position-0 feature and error nodes are dropped
  before comparing; every other direct effect is independent of which other nodes exist. Both get the
  same token ids, starting with BOS, so circuit-tracer prepends nothing.
- Logits: both target the logit minus the mean logit (circuit-tracer injects W_U[token] - mean(W_U)
  at the final norm's output; we inject e_token - 1/vocab at the logits: the same vector there), both
  freeze the final norm's scale, both choose the logits the same way (`desired_logit_prob`, `max_n_logits`).
- Error node: the MLP's output minus the transcoder's reconstruction (decoder bias and skip included)
  in both; the skip connection stays on the linear path in both.
- Embedding node: circuit-tracer's `embed_tokens.weight[token]`, ours the stream entering layer 0:
  equal for Arcee (no embedding scale).
- Node order: features by (layer, position, index), errors layer-major, embeddings, logits: both.
- Timing: CPU seconds of each process per `attribute` call (median of rounds after a warm-up, each call
  after an untimed `gc.collect()`: no call pays for garbage left before it), the same thread count and
  batch size on both sides; circuit-tracer's includes nnsight's tracing.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SIDE_PYTHON = ROOT / ".ci" / "ct-env" / "bin" / "python"
PROMPT = "When Mary and John went to the store together, John gave a drink to"


def timed(fn, rounds: int) -> tuple[object, float, float]:
    """fn's last result, and the median CPU and wall seconds of `rounds` calls after one warm-up, each
    call after a full garbage collection (untimed), so that no call pays for the garbage of what ran
    before it (a full collection over a process holding models and their imports takes 0.2 s, longer than
    the small cases' calls)."""
    cpu_times, wall_times, result = [], [], None
    for round_ in range(rounds + 1):
        result = None  # the previous call's graph collected too
        gc.collect()
        cpu, wall = time.process_time(), time.perf_counter()
        result = fn()
        if round_:
            cpu_times.append(time.process_time() - cpu)
            wall_times.append(time.perf_counter() - wall)
    return result, statistics.median(cpu_times), statistics.median(wall_times)


# ------------------------------------------------------------------------------------ the side half
def side_model(args):
    """circuit-tracer's NNSightReplacementModel of the checkpoint `args.model` with the per-layer transcoders
    saved in `args.transcoders` (float32, on the CPU, read whole), in the side environment."""
    import yaml
    from circuit_tracer.replacement_model.replacement_model_nnsight import NNSightReplacementModel
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    config = yaml.safe_load((args.transcoders / "config.yaml").read_text())
    paths = {layer: str(args.transcoders / name) for layer, name in enumerate(config["transcoders"])}
    transcoders = load_transcoder_set(paths, scan="hooked_models-random-jumprelu", feature_input_hook="mlp.hook_in",
                                      feature_output_hook="mlp.hook_out", device=torch.device("cpu"),
                                      dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)
    return NNSightReplacementModel.from_pretrained_and_transcoders(str(args.model), transcoders, device="cpu",
                                                                  dtype=torch.float32)


def side(args) -> None:
    """circuit-tracer's graph, in the side environment (imports nothing of hooked_models)."""
    from dataclasses import replace
    from importlib.metadata import version

    from circuit_tracer import attribute
    from circuit_tracer.utils import tl_nnsight_mapping

    # Arcee is registered nowhere in circuit-tracer: Llama's mapping fits it (issue 19).
    llama = tl_nnsight_mapping.get_mapping("LlamaForCausalLM")
    tl_nnsight_mapping._register(replace(llama, model_architecture="ArceeForCausalLM"))

    model = side_model(args)
    tokens = torch.tensor(json.loads(args.tokens))
    graph, cpu, wall = timed(lambda: attribute(tokens, model, batch_size=args.batch_size,
                                               desired_logit_prob=args.desired_logit_prob), args.rounds)
    torch.save({"adjacency_matrix": graph.adjacency_matrix, "active_features": graph.active_features,
                "selected_features": graph.selected_features, "activation_values": graph.activation_values,
                "logit_tokens": torch.tensor([int(t.vocab_idx) for t in graph.logit_targets]),
                "logit_probabilities": graph.logit_probabilities, "input_tokens": graph.input_tokens,
                "cpu_s": cpu, "wall_s": wall, "threads": torch.get_num_threads(),
                "versions": {p: version(p) for p in ("circuit-tracer", "nnsight", "transformers", "torch")}},
               args.out)


# ------------------------------------------------------------------------------------ the main half
def jumprelu_transcoders(model, d_transcoder: int, seed: int, threshold: float = 1.3):
    """Random per-layer JumpReLU transcoders with skip connections, every parameter non-trivial:
    unit decoder rows, the encoder their transpose, biases random, thresholds uniform in [threshold,
    threshold + 0.4] (1.3 on the embedded Arcee: about one in twelve of the features fire at a position)."""
    from hooked_models.transcoders import Transcoder, TranscoderSet, init_transcoder_

    generator = torch.Generator().manual_seed(seed)
    d = model.cfg.hidden_size
    layers = []
    for layer in range(model.cfg.num_layers):
        tc = Transcoder(d, d_transcoder, layer=layer, activation="jumprelu", skip=True)
        init_transcoder_(tc, seed=seed + layer)
        with torch.no_grad():
            tc.b_enc.copy_(0.1 * torch.randn(d_transcoder, generator=generator))
            tc.b_dec.copy_(0.1 * torch.randn(d, generator=generator))
            tc.W_skip.copy_(0.05 * torch.randn(d, d, generator=generator))
            tc.threshold.copy_(threshold + 0.4 * torch.rand(d_transcoder, generator=generator))
        layers.append(tc)
    return TranscoderSet(layers, model=model)


def compare(ours, theirs: dict) -> dict:
    """Our graph restricted to circuit-tracer's nodes against circuit-tracer's graph: the node sets
    (features by (layer, position, index), logits by token) and the adjacency's largest difference.
    circuit-tracer has no position-0 features and keeps its position-0 errors as zero nodes: both are
    left out of the comparison (and its position-0 error columns checked to be zero)."""
    n_pos, n_layers = ours.n_pos, ours.n_layers
    errors = torch.arange(n_layers * n_pos)
    at_zero = errors % n_pos == 0
    our_features = (ours.active_features[:, 1] != 0).nonzero().flatten()
    their_features = theirs["active_features"][theirs["selected_features"]]
    n_theirs = their_features.shape[0]
    their_adjacency = theirs["adjacency_matrix"]
    node_sets_equal = (torch.equal(ours.active_features[our_features], their_features)
                       and torch.equal(ours.logit_tokens, theirs["logit_tokens"]))
    if not node_sets_equal:
        return {"node_sets_equal": False, "our_features": int(our_features.numel()), "their_features": n_theirs,
                "our_logits": ours.logit_tokens.tolist(), "their_logits": theirs["logit_tokens"].tolist()}
    ours_index = torch.cat([our_features, ours.error_start + errors[~at_zero],
                            torch.arange(ours.embedding_start, ours.n_nodes)])
    their_index = torch.cat([torch.arange(n_theirs), n_theirs + errors[~at_zero],
                             torch.arange(n_theirs + n_layers * n_pos, their_adjacency.shape[0])])
    a = ours.adjacency_matrix[ours_index][:, ours_index].double()
    b = their_adjacency[their_index][:, their_index].double()
    scale, diff = float(b.abs().max()), float((a - b).abs().max())
    return {
        "node_sets_equal": True,
        "nodes_compared": len(ours_index),
        "features": n_theirs,
        "our_position_0_features_left_out": int(ours.n_features - our_features.numel()),
        "logit_tokens": ours.logit_tokens.tolist(),
        "edges_nonzero": int((b != 0).sum()),
        "max_abs_adjacency": scale,
        "max_abs_diff": diff,
        "max_abs_diff_relative": diff / scale,
        "max_abs_activation_diff": float((ours.activation_values[our_features] - theirs["activation_values"]).abs().max()),
        "max_abs_logit_probability_diff": float((ours.logit_probabilities - theirs["logit_probabilities"]).abs().max()),
        "their_position_0_error_columns_zero": bool((their_adjacency[:, n_theirs + errors[at_zero]] == 0).all()),
    }


def side_by_side(model, prompt: str, d_transcoder: int, *, checkpoint: Path | None = None, threshold: float = 1.3,
                 batch_size: int = 64, rounds: int = 5, desired_logit_prob: float = 0.95, threads: int | None = None,
                 seed: int = 0, side_python: Path = SIDE_PYTHON, seq: int | None = None) -> dict:
    """One case: random JumpReLU transcoders of width `d_transcoder` for `model`, loaded by circuit-tracer
    from `checkpoint` (default: the embedded Arcee's directory), its graph of `prompt` (continued to `seq`
    tokens by random ones, seeded, where given) from the side environment, ours here, compared and timed."""
    from hooked_models.attribution import attribute
    from hooked_models.embedded import embedded_checkpoint

    checkpoint = embedded_checkpoint("arcee") if checkpoint is None else checkpoint

    if not Path(side_python).exists():
        raise FileNotFoundError(f"{side_python} not found: build the side environment with `bash .ci/ct-env.sh`")
    tokens = model.to_tokens(prompt)
    if int(tokens[0, 0]) != model.tokenizer.bos_token_id:
        raise ValueError(f"the prompt's tokens start with {int(tokens[0, 0])}, not BOS: circuit-tracer would "
                         "prepend one")
    tokens = continued(tokens, seq, model.cfg.vocab_size, seed)
    transcoders = jumprelu_transcoders(model, d_transcoder, seed, threshold)
    with tempfile.TemporaryDirectory() as tmp:
        transcoders.save(Path(tmp) / "transcoders")
        out = Path(tmp) / "circuit_tracer_graph.pt"
        command = [str(side_python), __file__, "--side", "--model", str(checkpoint),
                   "--transcoders", str(Path(tmp) / "transcoders"), "--tokens", json.dumps(tokens[0].tolist()),
                   "--out", str(out), "--batch-size", str(batch_size), "--rounds", str(rounds),
                   "--desired-logit-prob", str(desired_logit_prob)]
        if threads:
            command += ["--threads", str(threads)]
        # The side environment's own packages only: nothing of this one on its path.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run(command, check=True, env=env, cwd=tmp)
        theirs = torch.load(out)
    graph, cpu, wall = timed(lambda: attribute(model, tokens, transcoders, batch_size=batch_size,
                                               desired_logit_prob=desired_logit_prob, head_loadings=False), rounds)
    figures = compare(graph, theirs)
    figures.update(
        d_transcoder=d_transcoder,
        hooked_models={"cpu_s": round(cpu, 4), "wall_s": round(wall, 4)},
        circuit_tracer={"cpu_s": round(theirs["cpu_s"], 4), "wall_s": round(theirs["wall_s"], 4),
                        "threads": theirs["threads"]},
        # circuit-tracer's time over ours: above 1, ours is faster.
        speed_up_cpu=round(theirs["cpu_s"] / cpu, 3), speed_up_wall=round(theirs["wall_s"] / wall, 3),
    )
    figures["circuit_tracer_versions"] = theirs["versions"]
    return figures


def continued(tokens: torch.Tensor, seq: int | None, vocab: int, seed: int) -> torch.Tensor:
    """The prompt's [1 seq] tokens continued to `seq` by random ones (ids 3 on: no special token)."""
    if seq is None or seq <= tokens.shape[1]:
        return tokens
    extra = torch.randint(3, vocab, (1, seq - tokens.shape[1]), generator=torch.Generator().manual_seed(seed))
    return torch.cat([tokens, extra], 1)


def random_arcee(directory: Path, tokenizer, seed: int = 0):
    """A random 8-layer, 1024-wide GQA Arcee (the benchmarks' shape, benchmarks/common.py) over the embedded
    tokenizer's 127 tokens, written to `directory` as transformers 4.57 reads it and loaded back from there."""
    from transformers import ArceeForCausalLM

    from benchmarks.common import hf_arcee_config, randomize_
    from hooked_models import HookedArcee
    from weight_conversion.arcee import save_arcee_checkpoint

    shape = argparse.Namespace(vocab=len(tokenizer), hidden=1024, intermediate=4096, layers=8, heads=8, kv_heads=2,
                               head_dim=128)
    torch.manual_seed(seed)
    model = HookedArcee.from_hf(randomize_(ArceeForCausalLM(hf_arcee_config(shape)), seed))
    model.tokenizer = tokenizer
    save_arcee_checkpoint(model, directory)
    return HookedArcee.from_pretrained(directory).eval()


def side_parser(doc: str, model: str, out: str) -> argparse.ArgumentParser:
    """The arguments both halves of a side-by-side benchmark share: the circuit-tracer half's inputs (`model`,
    `out`: what its --model and --out name) and the side environment's python."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", action="store_true", help="the circuit-tracer half (run in .ci/ct-env)")
    parser.add_argument("--model", type=Path, help=f"(--side) {model}")
    parser.add_argument("--transcoders", type=Path, help="(--side) the transcoders' directory")
    parser.add_argument("--tokens", help="(--side) the prompt's token ids, as JSON")
    parser.add_argument("--out", type=Path, help=f"(--side) {out}")
    parser.add_argument("--side-python", type=Path, default=SIDE_PYTHON,
                        help="the side environment's python (default: %(default)s)")
    parser.add_argument("--prompt", default=PROMPT)
    return parser


def main() -> None:
    parser = side_parser(__doc__, "the model's directory", "where to save its graph")
    parser.add_argument("--seqs", type=int, nargs="+", default=[16, 64],
                        help="prompt lengths, one case each: the prompt continued by random tokens (default: %(default)s)")
    parser.add_argument("--d-transcoder", type=int, nargs="+", default=[256, 1024],
                        help="transcoder widths, one case each (default: %(default)s)")
    parser.add_argument("--random-width", type=int, default=4096,
                        help="also a random 8 x 1024 Arcee with transcoders this wide (0: not)")
    parser.add_argument("--random-threshold", type=float, default=2.8,
                        help="its JumpReLU thresholds' lower end (default: %(default)s)")
    parser.add_argument("--desired-logit-prob", type=float, default=0.99999,
                        help="both sides' logit cover (default: %(default)s: ten logits on the confident "
                             "embedded model)")
    parser.add_argument("--batch-size", type=int, default=64, help="targets per backward pass, both sides")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls after a warm-up; the median is reported")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, both sides (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default="circuit_tracer_compare",
                        help="write benchmarks/results/RESULTS.json (default: %(default)s)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.side:
        return side(args)

    sys.path.insert(0, str(ROOT))
    from benchmarks.common import Results
    from hooked_models.families import load_model

    results = Results(args.results)
    embedded = load_model("embedded", family="arcee")
    cases = []

    def run(label: str, model, width: int, **kwargs) -> None:
        for seq in args.seqs:
            case = side_by_side(model, args.prompt, width, batch_size=args.batch_size, rounds=args.rounds,
                                desired_logit_prob=args.desired_logit_prob, threads=args.threads, seed=args.seed,
                                side_python=args.side_python, seq=seq, **kwargs)
            cases.append({"model": label, "tokens": seq, **case})
            print(f"{label}, d_transcoder {width}, {seq} tokens: {json.dumps(case, indent=1)}")

    for width in args.d_transcoder:
        run("embedded Arcee (2 layers, hidden 64)", embedded, width)
    if args.random_width:
        with tempfile.TemporaryDirectory() as tmp:
            model = random_arcee(Path(tmp) / "arcee", embedded.tokenizer, args.seed)
            run("random Arcee (8 layers, hidden 1024)", model, args.random_width, checkpoint=Path(tmp) / "arcee",
                threshold=args.random_threshold)
    results.save({"prompt": args.prompt, "tokens": int(embedded.to_tokens(args.prompt).shape[1]),
                  "batch_size": args.batch_size, "rounds": args.rounds, "desired_logit_prob": args.desired_logit_prob,
                  "transcoders": "random per-layer JumpReLU, skip connections, saved by TranscoderSet.save",
                  "cases": cases})

if __name__ == "__main__":
    main()
