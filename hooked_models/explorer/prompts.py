"""A prompt as the model will read it, and what was changed to get there, said in words the page shows.

Three changes are possible, each with a notice: words outside the tokenizer's vocabulary read as its
unknown token (`to_tokens` warns; the warning becomes the notice); a prompt longer than the model's
positions is cut there; and a model that computes only at some lengths (alpha-er: multiples of
mlp_experts up to block_size) gets its prompt padded after the text as its `generate` does (the family's
own decoder says the window and the pad id), which cannot change the real positions' logits (attention is
causal).
"""

import warnings
from dataclasses import dataclass, field

import torch


@dataclass
class Prompt:
    """Token ids [1 seq], the number of them that are the prompt's (`real`; the rest is padding), and
    the notices saying what was cut, replaced or padded."""

    tokens: torch.Tensor
    real: int
    notices: list[str] = field(default_factory=list)

    def fields(self, model) -> dict:
        """What every response about this prompt carries: its tokens, which are real, the notices."""
        return {"tokens": model.to_str_tokens(self.tokens[0]), "real": self.real, "notices": self.notices}


def read_prompt(model, text: str, what: str = "the prompt") -> Prompt:
    """`text` as `model` reads it (BOS first), cut or padded to a length it computes at, with notices."""
    if not text.strip():
        raise ValueError(f"{what} is empty")
    notices = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = model.to_tokens(text, truncate=False)
    notices += [f"{what}: {w.message}" for w in caught if "vocabulary" in str(w.message)]
    limit, seq = model.max_positions, tokens.shape[1]
    if seq > limit:
        dropped = model.to_string(tokens[0, limit:])
        shown = dropped if len(dropped) <= 60 else f"{dropped[:57]}..."
        notices.append(f"{what} is {seq} tokens and the model takes {limit}: cut after token {limit - 1}, "
                       f"dropping {seq - limit} tokens ({shown!r})")
        tokens = tokens[:, :limit]
    real = tokens.shape[1]
    problem = model.length_problem(real)
    if problem is not None:
        window, pad_id = _window(model)
        if window is None or real > window:
            raise ValueError(f"{what}: {problem}")
        padded = torch.full((1, window), pad_id, dtype=tokens.dtype, device=tokens.device)
        padded[:, :real] = tokens
        tokens = padded
        pad = model.to_str_tokens([pad_id])[0]
        notices.append(f"{what} is {real} tokens; {problem.split(':')[0]}, so it is padded after the text to "
                       f"{window} with {window - real} × {pad!r}, as generate does: positions 0-{real - 1} are the "
                       "prompt's, and causal attention keeps the padding out of them")
    return Prompt(tokens, real, notices)


def _window(model) -> tuple[int | None, int]:
    """The window and pad id of a model whose `generate` pads each prompt to one length, else (None, 0)."""
    decoder = model._decoder(use_cache=False) if hasattr(model, "_decoder") else None
    return getattr(decoder, "block_size", None), getattr(decoder, "pad_id", 0)


def read_pair(model, clean: str, corrupted: str) -> tuple[Prompt, Prompt]:
    """The clean and corrupted prompts, of one length before any padding (patching compares them
    position by position)."""
    first, second = read_prompt(model, clean, "the clean prompt"), read_prompt(model, corrupted, "the corrupted prompt")
    if first.real != second.real:
        raise ValueError(f"the clean prompt is {first.real} tokens and the corrupted one {second.real}: patching "
                         "needs prompts of one length")
    return first, second
