"""The command line: corpus-scale runs (hooked_models/corpus/), training transcoders
(hooked_models/transcoders/training/) and the explorer (hooked_models/explorer/).

    python -m hooked_models harvest --model embedded --names layers.1.layer_output --dataset PATH --out DIR
    python -m hooked_models harvest ... --engine ray --workers 2
    python -m hooked_models patch --model embedded --pairs PATH --value layer_input --over layer seq
    python -m hooked_models train-transcoders embedded --dataset PATH --activation topk --k 16 --out DIR
    torchrun --nproc-per-node 2 -m hooked_models train-transcoders ...   # or: ... --engine ray --workers 2
    python -m hooked_models explore --model embedded --data out       # the explorer, http://127.0.0.1:8000
    python -m hooked_models view-graphs out      # circuit-tracer's viewer on graphs written with features=

A user's error (a bad value, a missing file, an unknown name) is one line, in this command line's words
(`--context-size`, not the Python API's `context_size`); `--debug` shows the traceback instead. The
library (torch, TransformerLens) is imported only once the arguments are parsed, so --help is quick.
"""

import argparse
import os
import re
import sys
import time
from pathlib import Path

from hooked_models.corpus import ENGINES

# The Python API's argument names and the flags that set them: its messages are told in the flags' words.
FLAGS = {"context_size": "--context-size", "batch_size": "--batch-size", "shard_size": "--shard-size",
         "num_workers": "--workers", "chunk_size": "--chunk-size", "engine": "--engine", "family": "--family",
         "dtype": "--dtype", "column": "--column", "out": "--out", "dataset": "--dataset", "names": "--names",
         "cpus_per_worker": "--cpus-per-worker", "pairs": "--pairs", "value": "--value", "over": "--over", "direction": "--direction",
         # train-transcoders: TrainingConfig's fields (and train_transcoders's arguments)
         "d_transcoder": "--width", "k": "--k", "activation": "--activation", "layers": "--layers",
         "steps": "--steps", "batch_tokens": "--batch-tokens", "lr": "--lr", "layout": "--layout",
         "streams": "--streams", "buffer_tokens": "--buffer-tokens", "forward_batch": "--forward-batch",
         **{name: "--" + name.replace("_", "-") for name in (
             "warmup_steps", "decay_fraction", "init", "init_scale", "init_spread", "auxk_alpha", "dead_tokens",
             "sparsity", "penalty", "tanh_scale", "pre_act_loss", "threshold", "bandwidth", "threshold_momentum",
             "seed", "checkpoint_every", "log_every", "checkpoint")}}
# API words that only ever mean their flag, also without a value (`context_size is needed ...`).
_BARE = ("context_size", "batch_size", "shard_size", "num_workers", "chunk_size", "batch_tokens", "d_transcoder")
# name=value, the value quoted, a tuple or list (`layers=(0, 5)` -> `--layers 0 5`) or one word.
_ASSIGNED = re.compile(rf"\b({'|'.join(FLAGS)})=('[^']*'|\"[^\"]*\"|\([^()]*\)|\[[^\]]*\]|[^\s,;:)]+)")


def _flag_value(match: re.Match) -> str:
    value = match.group(2).strip("'\"")
    if value[:1] in "([":
        value = " ".join(v.strip(" '\"") for v in value[1:-1].split(",") if v.strip())
    return FLAGS[match.group(1)] + " " + value


def cli_words(message: str) -> str:
    """An API message in the command line's words, on one line: `context_size=17` -> `--context-size 17`,
    `layers=(0, 5)` -> `--layers 0 5`, `pass resume=True` -> `drop --no-resume` (the command line resumes
    unless told not to), `pass k=None` -> `drop --k`."""
    message = message.replace("pass resume=True", "drop --no-resume").replace("pass k=None", "drop --k")
    message = _ASSIGNED.sub(_flag_value, message)
    message = re.sub(rf"(?<![\w-])({'|'.join(_BARE)})\b", lambda m: FLAGS[m.group(1)], message)
    return " ".join(message.split())


def _dtype(name: str):
    """--dtype's type: a torch dtype by name (torch imported only when the flag is given)."""
    from hooked_models.dtypes import dtype_argument

    return dtype_argument(name)


def _positive(text: str) -> int:
    """A positive integer flag (argparse names the flag in its error)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


COMMON = """
--model is a checkpoint path (an HF Arcee directory, an alpha-er file or directory: the family is
detected), "embedded" (the small IOI model shipped in the package; --family picks which), or a Hub
id in the local cache. With --engine ray the run joins the Ray cluster RAY_ADDRESS names, else
starts one on this machine.
"""


def _command(commands, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    """A subcommand with the flags harvest and patch share (the model, its dtype, the engine)."""
    parser = commands.add_parser(name, help=summary, description=description + COMMON,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="checkpoint path, 'embedded', or a Hub id in the local cache")
    _model_flags(parser)
    _run_flags(parser, "'local': this process; 'ray': an actor pool of --workers replicas",
               "model replicas with --engine ray, one GPU each where the cluster has GPUs")
    return parser


def _model_flags(parser: argparse.ArgumentParser) -> None:
    """--family and --dtype: which embedded model, and the dtype it runs in."""
    parser.add_argument("--family", choices=("arcee", "alpha_er", "alpha-er"), default=None,
                        help="the family 'embedded' means (default: arcee); a path's family is detected")
    parser.add_argument("--dtype", type=_dtype, default=None, metavar="DTYPE",
                        help="dtype the model runs in (default: the checkpoint's)")


def _run_flags(parser: argparse.ArgumentParser, engine: str, workers: str) -> None:
    """--engine, --workers (what they mean for this command), --no-progress and --debug."""
    parser.add_argument("--engine", choices=ENGINES, default="local", help=f"{engine} (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1, help=f"{workers} (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _debug_flag(parser)


def _debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the traceback instead of the one-line message")


# --dataset as harvest and train-transcoders read it (corpus.data.read_corpus reads the path).
DATASET_HELP = ("a `datasets` directory saved by save_to_disk (a token column: tokens, input_ids or token_ids; or a "
                "text column, packed into --context-size windows), or token ids [n seq] in a .pt, .npy or "
                ".safetensors file (--column names the tensor of a file holding several)")


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: `harvest` and `patch`, every flag explained."""
    parser = argparse.ArgumentParser(prog="python -m hooked_models", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    harvest = _command(
        commands, "harvest", "write activations over a corpus to disk (SAELens's cached-activations layout)",
        "Write the activations of --names over a corpus to --out: a `datasets` dataset on disk with one "
        "[context_size, d] column per value and token_ids, in shards, with a manifest. Rerunning a killed "
        "harvest finishes it.")
    harvest.add_argument("--names", nargs="+", required=True,
                         help="values to store, standard or TransformerLens names (layers.1.layer_output, "
                              "blocks.0.attn.hook_z, ...)")
    harvest.add_argument("--dataset", required=True, help=DATASET_HELP)
    harvest.add_argument("--out", required=True, help="the output directory (empty, or a harvest to continue)")
    harvest.add_argument("--column", default=None, help="the dataset's column to read (default: by name)")
    harvest.add_argument("--context-size", type=int, default=None,
                         help="tokens per window: needed to pack text (default: the windows' own length)")
    harvest.add_argument("--batch-size", type=int, default=32, help="windows per forward (default: %(default)s)")
    harvest.add_argument("--shard-size", type=int, default=None,
                         help="windows per shard file, the unit of work a worker takes (default: about 64 MiB of "
                              "activations)")
    harvest.add_argument("--no-resume", action="store_true",
                         help="refuse a non-empty --out instead of continuing the harvest there")

    patch = _command(
        commands, "patch", "activation patching over a dataset of prompt pairs: the mean over the pairs",
        "Patch --value over --over at every location, on every pair of --pairs (a saved `datasets` directory "
        "with clean, corrupted, answer and wrong columns), in chunks; print the locations that move the mean "
        "logit difference most.")
    patch.add_argument("--pairs", required=True,
                       help="a `datasets` directory saved by save_to_disk: clean and corrupted token ids of one "
                            "length, answer and wrong token ids (and optionally position)")
    patch.add_argument("--value", default="layer_input",
                       help="the value to patch: a standard name (layer_input, attention_head_outputs, ...) or a "
                            "TransformerLens one (resid_pre, z) (default: %(default)s)")
    patch.add_argument("--over", nargs="+", default=None,
                       help="the value's dimensions to sweep, e.g. layer seq, or layer head (default: by layout)")
    patch.add_argument("--direction", choices=("denoising", "noising"), default="denoising",
                       help="denoising writes clean values into the corrupted run (default: %(default)s)")
    patch.add_argument("--chunk-size", type=int, default=64, help="pairs per chunk (default: %(default)s)")
    patch.add_argument("--top", type=_positive, default=10,
                       help="locations to print, those whose patch moves the metric (default: %(default)s)")
    patch.add_argument("--save", default=None, help="write the result (torch.save of its fields) to this file")
    patch.add_argument("--plot", default=None, help="write the result's heatmap to this PNG")

    _train_command(commands)
    _explore_command(commands)
    view = commands.add_parser(
        "view-graphs", help="circuit-tracer's viewer on the graphs of a directory, offline",
        description="Serve circuit-tracer's local viewer (its pages, their scripts vendored: nothing is fetched) "
                    "on the graphs that AttributionGraph.to_json(path, features=stats) wrote in DIR, and print "
                    "each graph's address (http://HOST:PORT/index.html?slug=...).")
    view.add_argument("data", metavar="DIR", help="the graphs' directory (graph-metadata.json, features/)")
    view.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    view.add_argument("--port", type=int, default=8032, help="port (default: %(default)s, circuit-tracer's)")
    _debug_flag(view)
    return parser


TRAIN_DESCRIPTION = """\
Train transcoders of MODEL's MLPs (each layer's mlp_input to its mlp.mlp_output) on the activations of
--dataset, streamed from the model as training consumes them, and write them to --out in circuit-tracer's
layout (load_transcoders(DIR) and circuit-tracer read it), with training.json (the config, the curves of
FVU, L0 and dead %) and training.png. Prints each layer's final FVU, L0 and dead %.

Across processes, unchanged: torchrun --nproc-per-node N -m hooked_models train-transcoders ..., or
--engine ray --workers N (Ray Train's workers); process 0 prints and writes. The same --streams trains on
N processes what one process trains. With --checkpoint DIR, rerunning a killed run resumes it.

MODEL is a checkpoint path (an HF Arcee directory, an alpha-er file or directory: the family is
detected), "embedded" (the small IOI model shipped in the package; --family picks which), a Hub id in the
local cache, or a `harvest` directory of every layer's mlp_input and mlp.mlp_output (then no --dataset).
"""


def _train_command(commands) -> None:
    """train-transcoders: the flags are TrainingConfig's fields (their defaults its own: a test checks)."""
    train = commands.add_parser("train-transcoders", help="train transcoders of a model's MLPs (or a harvest)",
                                description=TRAIN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("model", metavar="MODEL", help="checkpoint path, 'embedded', a Hub id in the local cache, "
                                                      "or a harvest directory")
    train.add_argument("--dataset", default=None, metavar="PATH", help=DATASET_HELP)
    train.add_argument("--out", required=True, metavar="DIR", help="the result directory (written by process 0)")
    train.add_argument("--eval-dataset", default=None, metavar="PATH",
                       help="held-out windows (as --dataset) the result is measured on at the end "
                            "(transcoders.evaluate: FVU, L0, dead %%, loss recovered, KL), into training.json")
    train.add_argument("--checkpoint", default=None, metavar="DIR",
                       help="checkpoints every --checkpoint-every steps, one file per process; a rerun resumes "
                            "from the last one")
    train.add_argument("--harvest-dir", default=None, metavar="DIR",
                       help="harvest the MLPs' inputs and outputs over --dataset to DIR first, then train on random "
                            "rows of it (default: streamed from the model, never stored)")
    train.add_argument("--context-size", type=int, default=None, metavar="N",
                       help="tokens per window: needed to pack text (default: the windows' own length)")
    train.add_argument("--column", default=None, help="the dataset's column to read (default: by name)")
    _model_flags(train)
    _run_flags(train, "'local': this process (or each of torchrun's); 'ray': --workers Ray Train workers",
               "training processes with --engine ray (Ray Train workers, gloo)")
    train.add_argument("--cpus-per-worker", type=float, default=None, metavar="X",
                       help="CPUs each Ray worker reserves, fractional on a small machine (default: 1, or the "
                            "cluster's CPUs shared among the workers where it has fewer)")

    what = train.add_argument_group("what is trained")
    what.add_argument("--width", dest="d_transcoder", type=int, default=256, metavar="N",
                      help="features per layer (default: %(default)s)")
    what.add_argument("--activation", choices=("relu", "topk", "batchtopk", "jumprelu"), default="relu",
                      help="topk and batchtopk keep --k features per token (batchtopk: k x batch per batch, saved as "
                           "JumpReLU with the threshold it learns); relu and jumprelu train a --sparsity penalty "
                           "(default: %(default)s)")
    what.add_argument("--k", type=int, default=None, help="features kept per token (topk and batchtopk need it)")
    what.add_argument("--skip", action="store_true", help="train a linear skip connection (W_skip) too")
    what.add_argument("--cross-layer", action="store_true",
                      help="one cross-layer transcoder: each layer's features write to it and every later layer")
    what.add_argument("--layers", type=int, nargs="+", default=None, metavar="L",
                      help="per-layer transcoders of these layers only; --out then holds their layer_L.safetensors "
                           "(default: every layer)")

    how = train.add_argument_group("how long and how fast")
    length = how.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=2000, metavar="N", help="optimizer steps (default: %(default)s)")
    length.add_argument("--tokens", type=_positive, default=None, metavar="N",
                        help="training tokens in all: --steps is TOKENS // --batch-tokens")
    how.add_argument("--batch-tokens", type=int, default=1024, metavar="N",
                     help="tokens per step, shared among the processes (default: %(default)s)")
    how.add_argument("--lr", type=float, default=2e-3, help="Adam's learning rate (default: %(default)s)")
    how.add_argument("--warmup-steps", type=int, default=None,
                     help="linear warm-up steps (default: a tenth of the steps, at most 1000)")
    how.add_argument("--decay-fraction", type=float, default=0.2,
                     help="the last fraction of the steps, over which lr decays linearly to 0 (default: %(default)s)")
    how.add_argument("--init", choices=("tied", "zero_decoder", "unit_decoder"), default="tied",
                     help="tied: decoder the encoder's transpose, rows of norm --init-scale; zero_decoder: "
                          "sparsify's; unit_decoder: unit rows, encoder their transpose (default: %(default)s)")
    how.add_argument("--init-scale", type=float, default=0.1,
                     help="decoder rows' norm with --init tied (default: %(default)s)")
    how.add_argument("--init-spread", choices=("equal", "drawn"), default="drawn",
                     help="equal: each encoder column scaled on the first batch so that every feature's "
                          "pre-activations spread as the average feature's do; drawn: as drawn (default: %(default)s)")
    how.add_argument("--seed", type=int, default=0, help="initialization and data order (default: %(default)s)")

    losses = train.add_argument_group("losses")
    losses.add_argument("--auxk-alpha", type=float, default=1 / 32,
                        help="topk, batchtopk: the AuxK loss's weight, 0 for none (default: 1/32)")
    losses.add_argument("--dead-tokens", type=int, default=1_000_000,
                        help="a feature that fired on none of this many tokens is dead (AuxK, dead %%) "
                             "(default: %(default)s)")
    losses.add_argument("--sparsity", type=float, default=1e-3,
                        help="relu: the L1 penalty by decoder norm; jumprelu: --penalty's weight "
                             "(default: %(default)s)")
    losses.add_argument("--penalty", choices=("tanh", "l0"), default="tanh",
                        help="jumprelu: Anthropic's tanh or the straight-through L0 (default: %(default)s)")
    losses.add_argument("--tanh-scale", type=float, default=4.0,
                        help="jumprelu: the scale inside the tanh penalty (default: %(default)s)")
    losses.add_argument("--pre-act-loss", type=float, default=0.0,
                        help="jumprelu: the pre-activation loss's weight, which pulls dead features back over their "
                             "thresholds (default: %(default)s)")
    losses.add_argument("--threshold", type=float, default=0.01,
                        help="jumprelu: initial threshold (default: %(default)s)")
    losses.add_argument("--bandwidth", type=float, default=0.05,
                        help="jumprelu: straight-through kernel width (default: %(default)s)")
    losses.add_argument("--threshold-momentum", type=float, default=0.01,
                        help="batchtopk: the running threshold's update weight (default: %(default)s)")

    data = train.add_argument_group("data and processes")
    data.add_argument("--buffer-tokens", type=int, default=65_536,
                      help="the shuffling buffer in tokens, 0 for the data's order (default: %(default)s)")
    data.add_argument("--forward-batch", type=int, default=32,
                      help="windows per forward of the model (default: %(default)s)")
    data.add_argument("--layout", choices=("data", "features"), default="data",
                      help="data: each process its share of every batch; features: each 1/N of every layer's "
                           "features (default: %(default)s)")
    data.add_argument("--streams", type=int, default=None,
                      help="how the data is split (default: one stream per process): the same --streams trains "
                           "the same thing on any number of processes that divides it")
    data.add_argument("--checkpoint-every", type=int, default=250,
                      help="steps between checkpoints, with --checkpoint (default: %(default)s)")
    data.add_argument("--log-every", type=int, default=10,
                      help="steps between points of the curves (default: %(default)s)")


def _explore_command(commands) -> None:
    explore = commands.add_parser(
        "explore", help="the explorer: a local web app over a model (prompt, attention, patching, circuits, "
                        "features, attribution graphs)",
        description="Serve the explorer on http://HOST:PORT (127.0.0.1: this machine only), offline. The page "
                    "reads files (harvests, graph files) only under the --data directories.")
    explore.add_argument("--model", default="embedded",
                         help="checkpoint path, 'embedded', or a Hub id in the local cache (default: %(default)s)")
    _model_flags(explore)
    explore.add_argument("--data", nargs="+", default=[], metavar="DIR",
                         help="directories the page may read harvests and graph files from")
    explore.add_argument("--sae", nargs="+", default=[], metavar="DIR",
                         help="SAEs and transcoders for the features view: transcoder sets in circuit-tracer's "
                              "layout (config.yaml; 'embedded': the package's), SAELens directories (cfg.json; "
                              "needs sae_lens). Default: the transcoders the --data directories' graph files were "
                              "built with, where found (the embedded model's own, or a set in a --data folder)")
    explore.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    explore.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    _debug_flag(explore)


def _explore(args) -> int:
    """Check what needs no model (the data directories, the model's path, the port: bound now, so that
    nothing else takes it), then load the model, announce the URL and serve until SIGINT or SIGTERM."""
    for directory in args.data:
        if not Path(directory).is_dir():
            raise ValueError(f"--data {directory}: no such directory")
    if args.model != "embedded" and _looks_like_path(args.model) and not Path(args.model).exists():
        raise ValueError(f"--model {args.model}: no such file or directory")
    listening = _listen(args.host, args.port)
    from hooked_models.explorer import serve  # lazily: --help and the other commands need no web server
    from hooked_models.explorer.server import graph_transcoders, load_sae
    from hooked_models.families import load_model

    try:
        model = load_model(args.model, args.family, args.dtype)
        saes = {Path(path).name: load_sae(path, model) for path in args.sae}
        if not args.sae and args.data:  # a graph's directory alone: its graphs' transcoders, where at hand
            saes, notes = graph_transcoders(model, args.data, embedded=args.model == "embedded")
            for line in notes:
                print(f"features view: {line}", file=sys.stderr, flush=True)
            if saes:
                print(f"features view: the graphs' transcoders {', '.join(saes)} (no --sae given)", flush=True)
    except BaseException:
        listening.close()
        raise
    print(f"explorer on http://{args.host}:{args.port} ({type(model).__name__}); Ctrl-C stops it", flush=True)
    try:
        serve(model, args.data, saes, host=args.host, port=args.port, sockets=[listening])
    except KeyboardInterrupt:  # SIGINT (SIGTERM ends the process by its default action once uvicorn has stopped)
        print("\nstopped: the jobs running or queued were cancelled", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # A job may still be inside one torch operation on its (daemon) thread; the interpreter's own
        # shutdown would abort under it, so the process ends here, with nothing left to save.
        os._exit(130)
    return 0


def _looks_like_path(model: str) -> bool:
    """A --model that can only be a path (a Hub id is "owner/name": never absolute, never starting with a dot)."""
    return model.startswith(("/", ".", "~")) or Path(model).suffix in (".pt", ".safetensors", ".bin")


def _listen(host: str, port: int):
    """A socket bound to host:port, or a ValueError in the command line's words if it cannot be."""
    import socket

    try:
        return socket.create_server((host, port))
    except OSError as error:
        reason = "is in use" if error.errno in (98, 48, 10048) else f"cannot be bound ({error.strerror})"
        raise ValueError(f"--port {port} on {host} {reason}; pick another with --port") from None


def main(argv: list[str] | None = None) -> int:
    """Run the command line; 0 on success, 2 for a user's error (one line on stderr), 130 on Ctrl-C."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from hooked_models.corpus.store import HarvestInProgress

    commands = {"explore": _explore, "harvest": _harvest, "patch": _patch, "train-transcoders": _train_transcoders,
                "view-graphs": _view_graphs}
    # Under torchrun every process runs this; process 0 alone reports (each raises the same error).
    reports = int(os.environ.get("RANK", "0")) == 0
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        if reports:
            print(f"\ninterrupted: {_INTERRUPTED[args.command](args)}", file=sys.stderr)
        return 130
    except (ValueError, KeyError, ImportError, OSError, HarvestInProgress) as error:
        if args.debug:
            raise
        quoted = isinstance(error, KeyError) and type(error).__str__ is KeyError.__str__  # str() quotes
        message = error.args[0] if quoted and error.args else str(error)
        if reports:
            message = cli_words(str(message))
            if getattr(args, "dataset", None) is not None:  # "the dataset has no rows" -> "--dataset x.npy has ..."
                message = re.sub(r"^[Tt]he dataset\b", f"--dataset {args.dataset}", message)
            print(f"{parser.prog} {args.command}: error: {message} (--debug shows the traceback)", file=sys.stderr)
        return 2


# What Ctrl-C leaves of each command's run.
_INTERRUPTED = {
    "harvest": lambda args: f"the shards done are kept in {args.out}; run the same command again to resume",
    "patch": lambda args: "patch keeps nothing of an unfinished run",
    "train-transcoders": lambda args: (
        f"the last checkpoint in {args.checkpoint} is kept; run the same command again to resume"
        if args.checkpoint else "nothing is kept (with --checkpoint DIR, a rerun resumes)"),
}


def _view_graphs(args) -> int:
    from hooked_models.features.viewer import serve  # lazily: no torch for the other commands' --help

    serve(args.data, port=args.port, host=args.host)
    return 0


def _harvest(args) -> int:
    from hooked_models import corpus

    summary = corpus.harvest(
        args.model, args.dataset, args.names, args.out, context_size=args.context_size,
        batch_size=args.batch_size, dtype=args.dtype, engine=args.engine, num_workers=args.workers,
        resume=not args.no_resume, progress=False if args.no_progress else None, shard_size=args.shard_size,
        column=args.column, family=args.family)
    print(cli_words(str(summary)))
    return 0


def training_config(args):
    """The TrainingConfig the flags say: one field per flag (--width is d_transcoder), --tokens in steps."""
    from dataclasses import fields

    from hooked_models.transcoders.training import TrainingConfig

    values = {f.name: getattr(args, f.name) for f in fields(TrainingConfig)}
    if args.tokens is not None:
        if args.tokens < args.batch_tokens:
            raise ValueError(f"--tokens {args.tokens} is less than one batch (--batch-tokens {args.batch_tokens})")
        values["steps"] = args.tokens // args.batch_tokens
    if args.activation in ("topk", "batchtopk") and args.k is None:
        raise ValueError(f"--activation {args.activation} needs --k, the features kept per token")
    values["layers"] = None if args.layers is None else tuple(args.layers)
    return TrainingConfig(**values)


def _train_transcoders(args) -> int:
    """Train with TrainingConfig from the flags, here (or in each torchrun process) or on Ray; report."""
    import json

    from hooked_models.corpus.data import read_corpus
    from hooked_models.corpus.engines import check_engine
    from hooked_models.transcoders.training import train_transcoders, train_transcoders_on_ray

    check_engine(args.engine, args.workers)
    config = training_config(args)
    if args.dataset is None and not (Path(args.model) / "manifest.json").is_file():
        raise ValueError(f"--dataset is needed: MODEL {args.model} is not a harvest directory")
    if args.eval_dataset is not None:  # read now, not after training
        if args.dataset is None:
            raise ValueError(f"--eval-dataset {args.eval_dataset} runs the model: give MODEL a model and --dataset")
        try:
            read_corpus(args.eval_dataset, args.column)
        except ValueError as error:
            raise ValueError(f"--eval-dataset {args.eval_dataset}: {error}") from None
    job = dict(dataset=args.dataset, config=config, checkpoint=args.checkpoint, out=args.out,
               progress=False if args.no_progress else None, context_size=args.context_size, column=args.column,
               family=args.family, dtype=args.dtype, harvest_dir=args.harvest_dir, eval_dataset=args.eval_dataset)
    if args.engine == "ray":
        train_transcoders_on_ray(args.model, num_workers=args.workers, cpus_per_worker=args.cpus_per_worker, **job)
    else:
        train_transcoders(args.model, **job)
    if int(os.environ.get("RANK", "0")) == 0:
        report = json.loads((Path(args.out) / "training.json").read_text())
        run, final, held_out = report["run"], report["final"], report.get("evaluation")
        kind = "cross-layer transcoder" if config.cross_layer else "per-layer transcoders"
        print(f"trained {config.activation} {kind} of width {config.d_transcoder} on {run['tokens']:,} tokens "
              f"({config.steps} steps of {config.batch_tokens}), {run['processes']} process"
              f"{'es' if run['processes'] > 1 else ''} ({run['layout']}); last batch:")
        _print_layers(run["layers"], final["fvu"], final["l0"], final["dead_pct"])
        if held_out:
            print(f"held out ({held_out['tokens']:,} tokens): loss recovered {held_out['loss_recovered']:.4g}, "
                  f"loss gap {held_out['loss_gap']:.4g}, KL {held_out['kl_divergence']:.4g}")
            _print_layers(run["layers"], held_out["fvu"], held_out["l0"], held_out["dead_percent"])
        print(f"wrote {args.out}")
    return 0


def _print_layers(layers, fvu, l0, dead) -> None:
    for row in zip(layers, fvu, l0, dead, strict=True):
        print("  layer {}: FVU {:.4g}  L0 {:.1f}  dead {:.1f}%".format(*row))


def _patch(args) -> int:
    from hooked_models import corpus
    from hooked_models.corpus.engines import pool_size

    began = time.perf_counter()
    result = corpus.patch(args.model, args.pairs, args.value, args.over, engine=args.engine,
                          num_workers=args.workers, chunk_size=args.chunk_size,
                          progress=False if args.no_progress else None, family=args.family, dtype=args.dtype,
                          direction=args.direction)
    seconds = time.perf_counter() - began
    print(f"{result.method} of {result.value} ({result.direction}) over {' x '.join(result.axes) or 'nothing'}, "
          f"mean over {result.pairs} pairs: clean {result.clean_metric:.4g}, corrupted {result.corrupted_metric:.4g}")
    # Only locations whose patch moves the metric: the list is not padded with ones that change nothing.
    moved = int((result.effect() != 0).sum())
    for label, value in result.top(min(args.top, moved)):
        print(f"  {label:<24} {value:.4g}")
    if moved < min(args.top, result.values.numel()):
        print(f"  (the other {result.values.numel() - moved} locations: no effect)")
    chunks = -(-result.pairs // args.chunk_size)
    workers = pool_size(args.workers, chunks)
    ran = f"{workers} worker{'s' if workers > 1 else ''}"
    if workers < args.workers:
        ran += (f" (--workers {args.workers}, but {chunks} chunk{'s' if chunks > 1 else ''} of --chunk-size "
                f"{args.chunk_size})")
    print(f"patched {result.values.numel()} locations on {result.pairs} pairs ({result.tokens} prompt tokens) in "
          f"{seconds:.1f} s: {result.tokens / seconds:,.0f} tokens/s ({args.engine}, {ran})")
    if args.save:
        import dataclasses

        import torch

        torch.save(dataclasses.asdict(result), args.save)
        print(f"wrote {args.save}")
    if args.plot:
        result.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
