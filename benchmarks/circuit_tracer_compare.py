"""Side by side with circuit-tracer: the same attribution graph on Arcee models, and the time and memory ratios.

    python benchmarks/circuit_tracer_compare.py --threads 1          # needs .ci/ct-env (see below)

circuit-tracer (0.5.0) cannot share an environment with this package (its nnsight backend needs
transformers <= 4.57.3, this package >= 5), so each side runs in a worker process of its own, this script
with `--worker`, which loads each case's model and transcoders once and then answers one `attribute` call
per request (a JSON line on its standard input, the answer a JSON line on its output):
- circuit-tracer's worker runs in the side environment .ci/ct-env (torch 2.13 CPU, transformers 4.57,
  circuit-tracer 0.5.0 from PyPI: `bash .ci/ct-env.sh` builds it) and imports nothing of this package: it
  loads the model from its directory with circuit-tracer's `NNSightReplacementModel`, Llama's nnsight mapping
  registered for `ArceeForCausalLM` (Arcee is Llama with another MLP: the same module paths, the same RMSNorm
  and eager attention source), and the transcoders with its own `load_transcoder_set`;
- ours runs in this environment, the same model directory read by `HookedArcee.from_pretrained` and the same
  transcoder files by `load_transcoders`.
This process writes the transcoders (and the random models' checkpoints), drives both workers and compares.

Timing. The two sides are interleaved round by round (A B, then B A, ...: who goes first alternates), so a
change of the shared machine's load falls on both; each side runs every batch size of `--batch-sizes`
(`batch_size`: targets per backward pass), and the table gives each side at its own best batch size (the
lowest median) and both at circuit-tracer's best. Per call: CPU seconds of the worker (median over the
rounds, after one untimed warm-up per case and side, each call after an untimed `gc.collect()`), and the
peak resident memory above the worker's resident memory before the call (VmHWM, reset through
/proc/self/clear_refs before each call, after glibc's malloc_trim has returned the freed heap, minus VmRSS then). The load average before and after each case,
the thread count of each worker and every batch size's median are in the results file.

Cases (`CASES`): the embedded Arcee (2 layers, hidden 64; JumpReLU transcoders 1024 wide) with every
active feature at 16 and 64 tokens and with a feature budget (`max_feature_nodes`, how graphs are usually
built) at 32 and 64 tokens (it computes at most 64 positions), the budget case at 64 tokens again with our
default head loadings (which circuit-tracer does not compute: its row times circuit-tracer without them), a
random 8-layer, 1024-wide GQA Arcee (the benchmarks' shape over the embedded tokenizer, 4,096 features a
layer) at 16 tokens with every feature and at 32 and 128 with a budget, and a held-out shape nothing was tuned on (12 layers, hidden 512,
multi-head attention, 2,048 features) with a budget at 48 tokens. Transcoders: random per-layer JumpReLU
with skip connections and non-zero biases (`jumprelu_transcoders`), written by `TranscoderSet.save`
(circuit-tracer's layout). Not the shipped TopK ones: circuit-tracer's file loader knows ReLU and JumpReLU
only, and its `TopK` keeps negative pre-activations where ours zeroes them.

Conventions reconciled (each checked by the comparison, not assumed):
- Hook names: our config.yaml names our vocabulary (`mlp_input`, `mlp.mlp_output`); circuit-tracer's
  nnsight mapping knows TransformerLens names: its worker passes `mlp.hook_in` / `mlp.hook_out`.
- Position 0: both drop its features and zero its errors (ours by default, `keep_position_zero=False`);
  circuit-tracer's position-0 error columns are checked to be zero. Both get the same token ids, starting
  with BOS, so circuit-tracer prepends nothing.
- Logits: both target the logit minus the mean logit, both freeze the final norm's scale, both choose the
  logits the same way (`desired_logit_prob`, `max_n_logits`).
- Error node: the MLP's output minus the transcoder's reconstruction (decoder bias and skip included) in
  both; the skip connection stays on the linear path in both.
- Embedding node: circuit-tracer's `embed_tokens.weight[token]`, ours the stream entering layer 0: equal for
  Arcee (no embedding scale).
- Feature selection (a budget): both rank by influence on the logits through the rows computed so far and
  re-rank every `update_interval` (4) batches.
- Node order: features by (layer, position, index), errors layer-major, embeddings, logits: both.
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
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SIDE_PYTHON = ROOT / ".ci" / "ct-env" / "bin" / "python"
PROMPT = "When Mary and John went to the store together, John gave a drink to"


@dataclass(frozen=True)
class Case:
    """One row: a model (`model`: "embedded" or a random shape's name in `SHAPES`), its transcoders' width
    and JumpReLU threshold, the prompt's length, the feature budget (None: every active feature) and our
    head loadings (False, or attribute's default "pruned")."""

    label: str
    model: str
    d_transcoder: int
    tokens: int
    max_feature_nodes: int | None = None
    head_loadings: bool | str = False
    threshold: float = 1.3


# Random Arcee shapes over the embedded tokenizer: the benchmarks' (benchmarks/common.py) and one held out.
SHAPES = {"random": dict(hidden=1024, intermediate=4096, layers=8, heads=8, kv_heads=2, head_dim=128),
          "held-out": dict(hidden=512, intermediate=2048, layers=12, heads=8, kv_heads=8, head_dim=64)}
EMBEDDED, RANDOM, HELD_OUT = ("embedded Arcee (2 layers, hidden 64)", "random Arcee (8 layers, hidden 1024)",
                              "held-out Arcee (12 layers, hidden 512, MHA)")
CASES = [
    Case(EMBEDDED, "embedded", 1024, 16),
    Case(EMBEDDED, "embedded", 1024, 64),
    Case(EMBEDDED, "embedded", 1024, 32, max_feature_nodes=1024),
    Case(EMBEDDED, "embedded", 1024, 64, max_feature_nodes=2048),
    Case(EMBEDDED, "embedded", 1024, 64, max_feature_nodes=2048, head_loadings="pruned"),
    Case(RANDOM, "random", 4096, 16, threshold=2.8),
    Case(RANDOM, "random", 4096, 32, max_feature_nodes=512, threshold=2.8),
    Case(RANDOM, "random", 4096, 128, max_feature_nodes=512, threshold=2.8),
    Case(HELD_OUT, "held-out", 2048, 48, max_feature_nodes=512, threshold=1.9),
]


# ------------------------------------------------------------------------------------ in every worker
def peak_memory_reset() -> int:
    """Return the heap's free memory to the system (glibc's malloc_trim: else one side's call reuses what its
    previous call freed and shows no increase where the other's does), then reset the process's peak
    resident memory (VmHWM) to its current resident memory, which is returned (bytes)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def timed_call(fn) -> tuple[object, dict]:
    """fn's result, its CPU and wall seconds and its peak resident memory above the resident memory before
    it, the call made after a full garbage collection (untimed), so that no call pays for the garbage of
    what ran before it."""
    gc.collect()
    before = peak_memory_reset()
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return result, {"cpu_s": cpu, "wall_s": wall, "peak_bytes": _status("VmHWM") - before, "rss_before": before}


def timed(fn, rounds: int) -> tuple[object, float, float]:
    """fn's last result, and the median CPU and wall seconds of `rounds` calls after one warm-up (each as
    `timed_call`)."""
    cpu_times, wall_times, result = [], [], None
    for round_ in range(rounds + 1):
        result = None  # the previous call's graph collected too
        result, figures = timed_call(fn)
        if round_:
            cpu_times.append(figures["cpu_s"])
            wall_times.append(figures["wall_s"])
    return result, statistics.median(cpu_times), statistics.median(wall_times)


def serve(load, run) -> None:
    """A worker's loop: `{"op": "load", "key", "model", "transcoders"}` loads (`load(request)` -> state),
    `{"op": "run", "key", "tokens", "batch_size", ..., "save"}` times `run(state, request)` (its graph, saved
    by `run`'s second return value where "save" names a file), one JSON answer per line."""
    states = {}
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "load":
            states[request["key"]] = load(request)
            answer = {"threads": torch.get_num_threads()}
        elif request["op"] == "run":
            (graph, save), answer = timed_call(lambda: run(states[request["key"]], request))
            if request.get("save"):
                save(graph, request["save"])
            graph = save = None
        else:
            break
        print(json.dumps(answer), flush=True)


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


def circuit_tracer_worker() -> None:
    """circuit-tracer's side, in the side environment (imports nothing of hooked_models)."""
    from dataclasses import replace
    from importlib.metadata import version

    from circuit_tracer import attribute
    from circuit_tracer.utils import tl_nnsight_mapping

    # Arcee is registered nowhere in circuit-tracer: Llama's mapping fits it (issue 19).
    llama = tl_nnsight_mapping.get_mapping("LlamaForCausalLM")
    tl_nnsight_mapping._register(replace(llama, model_architecture="ArceeForCausalLM"))
    versions = {p: version(p) for p in ("circuit-tracer", "nnsight", "transformers", "torch")}

    def load(request):
        return side_model(argparse.Namespace(model=Path(request["model"]), transcoders=Path(request["transcoders"])))

    def run(model, request):
        graph = attribute(torch.tensor(request["tokens"]), model, batch_size=request["batch_size"],
                          max_feature_nodes=request.get("max_feature_nodes"),
                          desired_logit_prob=request["desired_logit_prob"])
        return graph, save

    def save(graph, path):
        torch.save({"adjacency_matrix": graph.adjacency_matrix, "active_features": graph.active_features,
                    "selected_features": graph.selected_features, "activation_values": graph.activation_values,
                    "logit_tokens": torch.tensor([int(t.vocab_idx) for t in graph.logit_targets]),
                    "logit_probabilities": graph.logit_probabilities, "versions": versions}, path)

    serve(load, run)


def hooked_models_worker() -> None:
    """Our side, in this environment."""
    sys.path.insert(0, str(ROOT))
    from hooked_models import HookedArcee
    from hooked_models.attribution import attribute
    from hooked_models.families import load_model
    from hooked_models.transcoders import load_transcoders

    def load(request):
        model = (load_model("embedded", family="arcee") if request["model"] == "embedded"
                 else HookedArcee.from_pretrained(request["model"]).eval())
        return model, load_transcoders(request["transcoders"], model=model)

    def run(state, request):
        model, transcoders = state
        graph = attribute(model, torch.tensor(request["tokens"]), transcoders, batch_size=request["batch_size"],
                          max_feature_nodes=request.get("max_feature_nodes"),
                          desired_logit_prob=request["desired_logit_prob"],
                          head_loadings=request.get("head_loadings", False))
        return graph, torch.save

    serve(load, run)


# ------------------------------------------------------------------------------------ the driver
class Worker:
    """One side's worker process, driven by JSON lines."""

    def __init__(self, name: str, python: Path, threads: int | None):
        command = [str(python), __file__, "--worker", name] + (["--threads", str(threads)] if threads else [])
        # The side environment's own packages only: nothing of this one on its path.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} if name == "circuit-tracer" else None
        self.name = name
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                        cwd=tempfile.gettempdir())

    def ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker stopped (exit {self.process.wait()}) on {request['op']}")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


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
    """Our graph against circuit-tracer's: the node sets (features by (layer, position, index), logits by
    token) and the adjacency's largest difference. circuit-tracer has no position-0 features and keeps its
    position-0 errors as zero nodes: a position-0 feature of ours (`keep_position_zero=True`) is left out,
    the position-0 error columns too (circuit-tracer's checked to be zero)."""
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
        shared = set(map(tuple, ours.active_features[our_features].tolist())) & set(map(tuple, their_features.tolist()))
        return {"node_sets_equal": False, "our_features": int(our_features.numel()), "their_features": n_theirs,
                "shared_features": len(shared), "our_logits": ours.logit_tokens.tolist(),
                "their_logits": theirs["logit_tokens"].tolist()}
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
        "active": int(theirs["active_features"].shape[0]),
        "our_position_0_features_left_out": int(ours.n_features - our_features.numel()),
        "logit_tokens": ours.logit_tokens.tolist(),
        "edges_nonzero": int((b != 0).sum()),
        "max_abs_adjacency": scale,
        "max_abs_diff": diff,
        "max_abs_diff_relative": diff / scale,
        "max_abs_activation_diff": float((ours.activation_values[our_features] - theirs["activation_values"][
            theirs["selected_features"]]).abs().max()),
        "max_abs_logit_probability_diff": float((ours.logit_probabilities - theirs["logit_probabilities"]).abs().max()),
        "their_position_0_error_columns_zero": bool((their_adjacency[:, n_theirs + errors[at_zero]] == 0).all()),
    }


def continued(tokens: torch.Tensor, seq: int | None, vocab: int, seed: int) -> torch.Tensor:
    """The prompt's [1 seq] tokens continued to `seq` by random ones (ids 3 on: no special token)."""
    if seq is None or seq <= tokens.shape[1]:
        return tokens
    extra = torch.randint(3, vocab, (1, seq - tokens.shape[1]), generator=torch.Generator().manual_seed(seed))
    return torch.cat([tokens, extra], 1)


def random_arcee(directory: Path, tokenizer, seed: int = 0, shape: str = "random"):
    """A random Arcee of `SHAPES[shape]` (default: the benchmarks' 8 x 1024 GQA one, benchmarks/common.py)
    over the embedded tokenizer's 127 tokens, written to `directory` as transformers 4.57 reads it and loaded
    back from there."""
    from transformers import ArceeForCausalLM

    from benchmarks.common import hf_arcee_config, randomize_
    from hooked_models import HookedArcee
    from weight_conversion.arcee import save_arcee_checkpoint

    torch.manual_seed(seed)
    config = hf_arcee_config(argparse.Namespace(vocab=len(tokenizer), **SHAPES[shape]))
    model = HookedArcee.from_hf(randomize_(ArceeForCausalLM(config), seed))
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
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides (default: %(default)s)")
    parser.add_argument("--worker", choices=["circuit-tracer", "hooked_models"], help="(internal) serve one side")
    parser.add_argument("--cases", type=int, nargs="+", default=None,
                        help="indices into CASES (default: all): " + "; ".join(
                            f"{i}: {c.model} {c.tokens} tokens" for i, c in enumerate(CASES)))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 16, 64, 128, 256],
                        help="targets per backward pass, swept on both sides (default: %(default)s)")
    parser.add_argument("--desired-logit-prob", type=float, default=0.99999,
                        help="both sides' logit cover (default: %(default)s: ten logits on the confident "
                             "embedded model)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds per batch size; the median")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default="circuit_tracer_compare",
                        help="write benchmarks/results/RESULTS.json (default: %(default)s)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker == "circuit-tracer":
        return circuit_tracer_worker()
    if args.worker == "hooked_models":
        return hooked_models_worker()
    sys.path.insert(0, str(ROOT))
    from benchmarks.circuit_tracer_driver import measure

    measure(CASES if args.cases is None else [CASES[i] for i in args.cases], args)


if __name__ == "__main__":
    main()
