"""What every patching run starts from: the prompts as tokens, the metric, the direction, the mask."""

from collections.abc import Callable, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

Metric = Callable[[Float[Tensor, "batch seq vocab_size"]], Tensor]

DIRECTIONS = ("denoising", "noising")


def logit_diff_metric(
    answers: Int[Tensor, " batch"] | Sequence[int], wrong: Int[Tensor, " batch"] | Sequence[int], position: int = -1
) -> Metric:
    """A metric: the mean over prompts of logit(answer) − logit(wrong) at `position`."""
    answers, wrong = torch.as_tensor(answers), torch.as_tensor(wrong)

    def metric(logits: Float[Tensor, "batch seq vocab_size"]) -> Tensor:
        last = logits[:, position].float()
        rows = torch.arange(last.shape[0], device=last.device)
        return (last[rows, answers.to(last.device)] - last[rows, wrong.to(last.device)]).mean()

    return metric


def _tokens(model, input) -> Tensor:
    tokens = model.to_tokens(input) if isinstance(input, (str, list)) else input
    if not isinstance(tokens, Tensor) or tokens.ndim != 2:
        raise ValueError("clean and corrupted must be token tensors [batch seq] (or text)")
    device = next(model.parameters()).device
    return tokens.to(device)


def _scalar(out, name: str = "metric") -> Tensor:
    out = torch.as_tensor(out)
    if out.numel() != 1:
        raise ValueError(f"the {name} must return a scalar (average over prompts); got shape {tuple(out.shape)}")
    return out.detach().float().reshape(())


def _runs(model, clean, corrupted, direction: str):
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'denoising' or 'noising', not {direction!r}")
    clean, corrupted = _tokens(model, clean), _tokens(model, corrupted)
    if clean.shape != corrupted.shape:
        raise ValueError(f"clean {tuple(clean.shape)} and corrupted {tuple(corrupted.shape)} tokens must have "
                         "one shape: a patch moves an activation between aligned positions")
    return (corrupted, clean) if direction == "denoising" else (clean, corrupted)


def _checked_attention_mask(attention_mask: Tensor | None, tokens: Tensor) -> Tensor | None:
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != tuple(tokens.shape):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask has shape {got}, but the prompts are {tuple(tokens.shape)}")
    return attention_mask.to(device=tokens.device, dtype=torch.long)
