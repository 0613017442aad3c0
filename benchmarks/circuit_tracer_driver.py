"""The driver of benchmarks/circuit_tracer_compare.py (this environment only): writes each case's model and
transcoders, starts both sides' workers, interleaves their calls round by round, compares their graphs and
writes benchmarks/results/circuit_tracer_compare.json. See circuit_tracer_compare.py's docstring."""

import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.circuit_tracer_compare import (
    PROMPT,
    SIDE_PYTHON,
    Case,
    Worker,
    compare,
    continued,
    jumprelu_transcoders,
    random_arcee,
)

SIDES = ("hooked_models", "circuit-tracer")


class Session:
    """Both workers, and the models and transcoders written for them under `directory`, each loaded once."""

    def __init__(self, directory: Path, *, side_python: Path = SIDE_PYTHON, threads: int | None = 1, seed: int = 0,
                 prompt: str = PROMPT):
        from hooked_models.embedded import embedded_checkpoint
        from hooked_models.families import load_model

        if not Path(side_python).exists():
            raise FileNotFoundError(f"{side_python} not found: build the side environment with `bash .ci/ct-env.sh`")
        self.directory, self.seed, self.prompt = directory, seed, prompt
        self.embedded = load_model("embedded", family="arcee")
        self.embedded_directory = embedded_checkpoint("arcee")
        tokens = self.embedded.to_tokens(prompt)
        if int(tokens[0, 0]) != self.embedded.tokenizer.bos_token_id:
            raise ValueError(f"the prompt's tokens start with {int(tokens[0, 0])}, not BOS: circuit-tracer would "
                             "prepend one")
        self.workers = {"hooked_models": Worker("hooked_models", Path(sys.executable), threads),
                        "circuit-tracer": Worker("circuit-tracer", Path(side_python), threads)}
        self.loaded: dict[str, tuple[str, str]] = {}
        self.threads: dict[str, int] = {}

    def key(self, case: Case) -> str:
        """Loads the case's model and transcoders in both workers (once), returns their key."""
        key = f"{case.model}-{case.d_transcoder}-{case.threshold}"
        if key in self.loaded:
            return key
        if case.model == "embedded":
            model, checkpoint, ours = self.embedded, self.embedded_directory, "embedded"
        else:
            checkpoint = self.directory / f"model-{case.model}"
            if not checkpoint.exists():
                random_arcee(checkpoint, self.embedded.tokenizer, self.seed, shape=case.model)
            from hooked_models import HookedArcee

            model, ours = HookedArcee.from_pretrained(checkpoint).eval(), str(checkpoint)
        transcoders = self.directory / f"transcoders-{key}"
        jumprelu_transcoders(model, case.d_transcoder, self.seed, case.threshold).save(transcoders)
        for side, where in (("hooked_models", ours), ("circuit-tracer", str(checkpoint))):
            self.threads[side] = self.workers[side].ask(op="load", key=key, model=where,
                                                        transcoders=str(transcoders))["threads"]
        self.loaded[key] = (ours, str(checkpoint))
        return key

    def tokens(self, case: Case) -> list[int]:
        tokens = continued(self.embedded.to_tokens(self.prompt), case.tokens, len(self.embedded.tokenizer), self.seed)
        return tokens[0].tolist()

    def run(self, side: str, case: Case, batch_size: int, desired_logit_prob: float, save: Path | None = None) -> dict:
        request = dict(op="run", key=self.key(case), tokens=self.tokens(case), batch_size=batch_size,
                       max_feature_nodes=case.max_feature_nodes, desired_logit_prob=desired_logit_prob,
                       save=None if save is None else str(save))
        if side == "hooked_models":
            request["head_loadings"] = case.head_loadings
        return self.workers[side].ask(**request)

    def compared(self, case: Case, batch_size: int, desired_logit_prob: float) -> dict:
        """Both graphs of the case at `batch_size`, compared (`compare`)."""
        paths = {side: self.directory / f"graph-{side}.pt" for side in SIDES}
        for side in SIDES:
            self.run(side, case, batch_size, desired_logit_prob, save=paths[side])
        theirs = torch.load(paths["circuit-tracer"])
        figures = compare(torch.load(paths["hooked_models"], weights_only=False), theirs)
        figures["circuit_tracer_versions"] = theirs["versions"]
        return figures

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


def interleaved(session: Session, case: Case, batch_sizes: list[int], rounds: int, desired_logit_prob: float,
                first: int = 0) -> dict:
    """Every batch size's rounds of both sides, interleaved (round r: one side then the other, who goes first
    alternating from round to round): {side: {batch_size: {"cpu_s", "wall_s" (medians), "peak_bytes" (the
    largest), "rounds_cpu_s"}}}."""
    for side in SIDES:  # one untimed warm-up each
        session.run(side, case, batch_sizes[0], desired_logit_prob)
    calls = {side: {b: [] for b in batch_sizes} for side in SIDES}
    for b in batch_sizes:
        for r in range(rounds):
            order = SIDES if (r + first) % 2 == 0 else SIDES[::-1]
            for side in order:
                calls[side][b].append(session.run(side, case, b, desired_logit_prob))
            print(f"  {case.model} {case.tokens} tokens, batch {b}, round {r}: " + ", ".join(
                f"{side} {calls[side][b][-1]['cpu_s']:.3f} s" for side in SIDES), file=sys.stderr, flush=True)
    return {side: {b: {"cpu_s": statistics.median(c["cpu_s"] for c in calls[side][b]),
                       "wall_s": statistics.median(c["wall_s"] for c in calls[side][b]),
                       "peak_bytes": max(c["peak_bytes"] for c in calls[side][b]),
                       "rounds_cpu_s": [round(c["cpu_s"], 4) for c in calls[side][b]]} for b in batch_sizes}
            for side in SIDES}


def best(timings: dict) -> int:
    """The batch size of the lowest median CPU time."""
    return min(timings, key=lambda b: timings[b]["cpu_s"])


def measured_case(session: Session, case: Case, args, index: int) -> dict:
    load_before = [round(x, 2) for x in os.getloadavg()]
    timings = interleaved(session, case, args.batch_sizes, args.rounds, args.desired_logit_prob, first=index)
    ours_best, their_best = best(timings["hooked_models"]), best(timings["circuit-tracer"])
    ours, theirs = timings["hooked_models"], timings["circuit-tracer"]
    figures = session.compared(case, their_best, args.desired_logit_prob)
    return {**asdict(case), **figures,
            "batch_sizes": {"hooked_models": ours_best, "circuit-tracer": their_best},
            "hooked_models": ours[ours_best], "circuit_tracer": theirs[their_best],
            # circuit-tracer's time over ours: above 1, ours is faster.
            "speed_up_cpu": round(theirs[their_best]["cpu_s"] / ours[ours_best]["cpu_s"], 3),
            "speed_up_cpu_same_batch": round(theirs[their_best]["cpu_s"] / ours[their_best]["cpu_s"], 3),
            "peak_ratio": round(ours[ours_best]["peak_bytes"] / max(theirs[their_best]["peak_bytes"], 1), 3),
            "sweep": {side: {str(b): v for b, v in t.items()} for side, t in timings.items()},
            "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()]}


def measure(cases: list[Case], args) -> None:
    from benchmarks.common import Results

    results = Results(args.results)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        session = Session(Path(tmp), side_python=args.side_python, threads=args.threads, seed=args.seed,
                          prompt=args.prompt)
        try:
            for index, case in enumerate(cases):
                rows.append(measured_case(session, case, args, index))
                print(json.dumps(rows[-1]), flush=True)
                # Saved after every case: a run stopped part way keeps what it measured.
                results.save({"prompt": args.prompt, "rounds": args.rounds,
                              "desired_logit_prob": args.desired_logit_prob, "batch_sizes": args.batch_sizes,
                              "threads": session.threads,
                              "interleaving": "round by round: one call of each side per round, who goes first "
                                              "alternating between rounds (and between cases); one untimed warm-up "
                                              "per case and side",
                              "transcoders": "random per-layer JumpReLU, skip connections, saved by TranscoderSet.save",
                              "cases": rows})
        finally:
            session.close()

