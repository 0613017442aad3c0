"""What the example scripts share: loading a model by path (detecting its family) and a task to patch.

The task is the embedded models' IOI task when the model speaks its vocabulary, IOI sentences
through the model's own tokenizer when it has one (AFM-4.5B), and induction on repeated random
tokens otherwise (an alpha-er checkpoint without a tokenizer): every model has something to find.
"""

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from hooked_models import families
from hooked_models.dtypes import DTYPE_NAMES, dtype_argument
from hooked_models.families import detect_family

FAMILIES = ("arcee", "alpha-er")
CHECKPOINTS = {"arcee": "an HF Arcee directory (AFM-4.5B)", "alpha-er": "an alpha-er checkpoint (file or directory)"}


def arguments(description: str, name: str, families: tuple[str, ...] = FAMILIES) -> argparse.ArgumentParser:
    """The options every example takes: --model, --device, --dtype, --out, --prompts, --seed, and --family
    where the script runs more than one family (`families`; the first is the default). `name` names the
    script's figure: by default out/NAME_FAMILY-MODEL.png (see `out_path`), so runs on different models
    keep their own."""
    parser = argparse.ArgumentParser(description=description)
    kinds = " or ".join(CHECKPOINTS[f] for f in families)
    parser.add_argument("--model", default="embedded",
                        help=f"'embedded' (the shipped IOI model) or a checkpoint: {kinds}"
                             + ("; the family is detected" if len(families) > 1 else ""))
    if len(families) > 1:
        # alpha-er or alpha_er: either spelling, as everywhere a family is named
        parser.add_argument("--family", type=lambda name: name.replace("_", "-"), choices=families, default=families[0],
                            help="which embedded model --model embedded means (default: %(default)s)")
    parser.set_defaults(family=families[0], families=families, figure=name)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", type=dtype_argument, default="float32", metavar="DTYPE",
                        help=f"one of {', '.join(DTYPE_NAMES)} (default: %(default)s)")
    parser.add_argument("--out", default=None,
                        help=f"where the figure (PNG) goes (default: out/{name}_FAMILY-MODEL.png, e.g. "
                             f"out/{name}_{families[0]}-embedded.png)")
    parser.add_argument("--prompts", type=int, default=32, help="clean/corrupted pairs (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=None, help="patched copies per forward (default: by memory)")
    return parser


def out_path(args: argparse.Namespace) -> Path:
    """--out, else out/NAME_FAMILY-MODEL.png: the family and the model's name (`embedded`, or the checkpoint's
    file or directory name), so that a run on another model writes beside the first instead of over it."""
    if args.out is not None:
        return Path(args.out)
    family = args.family if args.model == "embedded" else detect_family(args.model).replace("_", "-")
    model = "embedded" if args.model == "embedded" else Path(args.model.rstrip("/")).stem
    return Path("out") / f"{args.figure}_{family}-{model}.png"


def load_model(args: argparse.Namespace):
    """The model --model names, on --device in --dtype, in eval mode; a family the script does not run
    is refused before anything loads."""
    family = args.family if args.model == "embedded" else detect_family(args.model).replace("_", "-")
    if family not in args.families:
        raise SystemExit(f"{args.model} is {CHECKPOINTS[family]}; this script runs {' and '.join(args.families)} only")
    return families.load_model(args.model, family, dtype=args.dtype, device=args.device)


@dataclass
class Task:
    """Aligned clean and corrupted prompts, the metric (mean logit difference), and position labels."""

    name: str
    clean: torch.Tensor
    corrupted: torch.Tensor
    correct: torch.Tensor
    incorrect: torch.Tensor
    read_at: int
    position_labels: list[str]

    def metric(self, logits: torch.Tensor) -> torch.Tensor:
        """logit(correct) − logit(incorrect) at the answer position, averaged over prompts."""
        last = logits[:, self.read_at].float()
        rows = torch.arange(last.shape[0], device=last.device)
        return (last[rows, self.correct.to(last.device)] - last[rows, self.incorrect.to(last.device)]).mean()


def make_task(model, prompts: int = 32, seed: int = 0) -> Task:
    """The task that fits the model (see the module docstring), padded to a length it runs at."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return _fit_length(model, _induction(model, prompts, seed))
    from hooked_models.embedded import task as ioi

    if model.cfg.vocab_size == len(ioi.vocabulary()):
        # The embedded vocabulary: one template, so every prompt has its names at the same positions.
        pairs = ioi.make_ioi_prompts(prompts, seed, tokenizer=tokenizer, templates=(0,))
        # Positions named by role where the prompts differ: the names A, B, S2, and the place and object.
        roles = {int(pairs.positions["a"][0]): "A", int(pairs.positions["b"][0]): "B",
                 int(pairs.positions["s2"][0]): "S2"}
        labels = []
        for i, column in enumerate(pairs.clean_tokens.T.tolist()):
            word = "BOS" if column[0] == tokenizer.bos_token_id else tokenizer.decode([column[0]]).strip()
            if len(set(column)) > 1:
                word = roles.get(i, "PLACE" if word in ioi.PLACES else "OBJECT")
            labels.append(word)
        task = Task("IOI (embedded vocabulary)", pairs.clean_tokens, pairs.corrupted_tokens, pairs.correct,
                    pairs.incorrect, ioi.PROMPT_LENGTH - 1, labels)
    else:
        task = _text_ioi(model, ioi, prompts, seed) or _induction(model, prompts, seed)
    return _fit_length(model, task)


def _text_ioi(model, ioi, prompts: int, seed: int) -> Task | None:
    """IOI sentences through the model's own tokenizer; pairs whose token counts differ are dropped."""
    pairs = ioi.make_ioi_prompts(4 * prompts, seed, templates=(0,))
    clean, corrupted, correct, incorrect = [], [], [], []
    for i, (c, x) in enumerate(zip(pairs.clean_text, pairs.corrupted_text)):
        a, b = model.to_tokens(c)[0], model.to_tokens(x)[0]
        try:  # the answers must be one token each in the model's vocabulary (" Mary")
            io, s = (model.to_single_token(pairs.tokenizer.decode([int(t[i])]))
                     for t in (pairs.correct, pairs.incorrect))
        except ValueError:
            continue
        if a.shape == b.shape and (not clean or a.shape == clean[0].shape):
            clean.append(a), corrupted.append(b), correct.append(io), incorrect.append(s)
        if len(clean) == prompts:
            break
    if len(clean) < 2:
        return None
    labels = [t.strip() or t for t in model.to_str_tokens(clean[0])]
    return Task("IOI (the model's tokenizer)", torch.stack(clean), torch.stack(corrupted), torch.tensor(correct),
                torch.tensor(incorrect), len(labels) - 1, labels)


def _induction(model, prompts: int, seed: int, half: int = 7) -> Task:
    """[BOS r1 … rk r1 … r(k−1)] -> rk, against a corrupted first half (fresh tokens) whose answer differs."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    first = torch.randint(3, vocab, (prompts, half), generator=g)
    other = (first + torch.randint(1, vocab - 3, (prompts, half), generator=g) - 3) % (vocab - 3) + 3
    bos = torch.full((prompts, 1), getattr(model.cfg, "bos_token_id", None) or 1)
    clean = torch.cat([bos, first, first[:, :-1]], 1)
    corrupted = torch.cat([bos, other, first[:, :-1]], 1)
    labels = ["BOS"] + [f"r{i + 1}" for i in range(half)] + [f"r{i + 1}'" for i in range(half - 1)]
    return Task("induction on repeated random tokens", clean, corrupted, first[:, -1], other[:, -1],
                clean.shape[1] - 1, labels)


def _fit_length(model, task: Task) -> Task:
    """alpha-er runs only at lengths that are a multiple of its expert count: pad on the right (attention
    is causal, so the padding cannot reach the answer position) and keep reading at the last real one."""
    check = getattr(model, "check_length", None)
    seq = task.clean.shape[1]
    if check is None:
        return task
    try:
        check(seq)
        return task
    except ValueError:
        pass
    experts = model.cfg.mlp_experts
    target = -(-seq // experts) * experts
    pad = torch.zeros(task.clean.shape[0], target - seq, dtype=task.clean.dtype)
    task.clean, task.corrupted = torch.cat([task.clean, pad], 1), torch.cat([task.corrupted, pad], 1)
    task.position_labels = task.position_labels + ["pad"] * (target - seq)
    return task
