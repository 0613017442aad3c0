"""The command line: corpus-scale runs (hooked_models/corpus/) and the explorer (hooked_models/explorer/).

    python -m hooked_models harvest --model embedded --names layers.1.layer_output --dataset PATH --out DIR
    python -m hooked_models harvest ... --engine ray --workers 2
    python -m hooked_models patch --model embedded --pairs PATH --value layer_input --over layer seq
    python -m hooked_models explore --model embedded --data out       # the explorer, http://127.0.0.1:8000

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
         "pairs": "--pairs", "value": "--value", "over": "--over", "direction": "--direction"}
# API words that only ever mean their flag, also without a value (`context_size is needed ...`).
_BARE = ("context_size", "batch_size", "shard_size", "num_workers", "chunk_size")
_ASSIGNED = re.compile(rf"\b({'|'.join(FLAGS)})=('[^']*'|\"[^\"]*\"|[^\s,;:)]+)")


def cli_words(message: str) -> str:
    """An API message in the command line's words, on one line: `context_size=17` -> `--context-size 17`,
    `pass resume=True` -> `drop --no-resume` (the command line resumes unless told not to)."""
    message = message.replace("pass resume=True", "drop --no-resume")
    message = _ASSIGNED.sub(lambda m: FLAGS[m.group(1)] + " " + m.group(2).strip("'\""), message)
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
    """A subcommand with the flags both share (the model, its dtype, the engine)."""
    parser = commands.add_parser(name, help=summary, description=description + COMMON,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="checkpoint path, 'embedded', or a Hub id in the local cache")
    parser.add_argument("--family", choices=("arcee", "alpha_er", "alpha-er"), default=None,
                        help="the family 'embedded' means (default: arcee); a path's family is detected")
    parser.add_argument("--dtype", type=_dtype, default=None, metavar="DTYPE",
                        help="dtype the model runs in (default: the checkpoint's)")
    parser.add_argument("--engine", choices=ENGINES, default="local",
                        help="'local': this process; 'ray': an actor pool of --workers replicas (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1,
                        help="model replicas with --engine ray, one GPU each where the cluster has GPUs "
                             "(default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the traceback instead of the one-line message")
    return parser


def _dataset(path: str):
    """A saved `datasets` directory, or token ids [n seq] in a .pt or .npy file."""
    suffix = Path(path).suffix
    if suffix == ".pt":
        import torch

        return torch.load(path, weights_only=True)
    if suffix == ".npy":
        import numpy as np

        return np.load(path)
    return path


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
    harvest.add_argument("--dataset", required=True,
                         help="a `datasets` directory saved by save_to_disk (a token column: tokens, input_ids "
                              "or token_ids; or a text column, packed into windows), or token ids [n seq] in a "
                              ".pt or .npy file")
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

    _explore_command(commands)
    return parser


def _explore_command(commands) -> None:
    explore = commands.add_parser(
        "explore", help="the explorer: a local web app over a model (prompt, attention, patching, circuits, "
                        "features, attribution graphs)",
        description="Serve the explorer on http://HOST:PORT (127.0.0.1: this machine only), offline. The page "
                    "reads files (harvests, graph files) only under the --data directories.")
    explore.add_argument("--model", default="embedded",
                         help="checkpoint path, 'embedded', or a Hub id in the local cache (default: %(default)s)")
    explore.add_argument("--family", choices=("arcee", "alpha_er", "alpha-er"), default=None,
                         help="the family 'embedded' means (default: arcee); a path's family is detected")
    explore.add_argument("--dtype", type=_dtype, default=None, metavar="DTYPE",
                         help="dtype the model runs in (default: the checkpoint's)")
    explore.add_argument("--data", nargs="+", default=[], metavar="DIR",
                         help="directories the page may read harvests and graph files from")
    explore.add_argument("--sae", nargs="+", default=[], metavar="DIR",
                         help="SAEs and transcoders for the features view: transcoder sets in circuit-tracer's "
                              "layout (config.yaml; 'embedded': the package's), SAELens directories (cfg.json; "
                              "needs sae_lens)")
    explore.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    explore.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    explore.add_argument("--debug", action="store_true",
                         help="on an error, show the traceback instead of the one-line message")


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
    from hooked_models.explorer.server import load_sae
    from hooked_models.families import load_model

    try:
        model = load_model(args.model, args.family, args.dtype)
        saes = {Path(path).name: load_sae(path, model) for path in args.sae}
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

    try:
        if args.command == "explore":
            return _explore(args)
        return _harvest(args) if args.command == "harvest" else _patch(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        if args.command == "harvest":
            print(f"\ninterrupted: the shards done are kept in {args.out}; run the same command again to resume",
                  file=sys.stderr)
        else:
            print("\ninterrupted: patch keeps nothing of an unfinished run", file=sys.stderr)
        return 130
    except (ValueError, KeyError, ImportError, OSError, HarvestInProgress) as error:
        if args.debug:
            raise
        message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        print(f"{parser.prog} {args.command}: error: {cli_words(str(message))} (--debug shows the traceback)",
              file=sys.stderr)
        return 2


def _harvest(args) -> int:
    from hooked_models import corpus

    summary = corpus.harvest(
        args.model, _dataset(args.dataset), args.names, args.out, context_size=args.context_size,
        batch_size=args.batch_size, dtype=args.dtype, engine=args.engine, num_workers=args.workers,
        resume=not args.no_resume, progress=False if args.no_progress else None, shard_size=args.shard_size,
        column=args.column, family=args.family)
    print(cli_words(str(summary)))
    return 0


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
