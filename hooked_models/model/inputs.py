"""The forward's inputs: text to tokens and back, and the checks that give a clear error for anything the
model cannot run (token ids, masks, lengths)."""

import os
import sys
import warnings

import torch
from torch import Tensor

# The package's directory (hooked_models/), for the warnings' stack level: a frame in it is not the user's.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DECORATORS = {"torch", "jaxtyping", "beartype", "transformer_lens"}   # wrappers around our methods



class Inputs:
    """`HookedModel`'s inputs: `to_tokens`, `to_string`, `to_str_tokens`, `to_single_token`, and the checks
    of tokens, masks and lengths the forward runs (a family adds its rules in `length_problem` and
    `_check_sequence`)."""

    @property
    def max_positions(self) -> int:
        return self.cfg.n_ctx

    def length_problem(self, seq: int) -> str | None:
        """Why the model does not compute at sequence length `seq` (None if it does); families add rules."""
        return f"{seq} positions exceed the model's {self.max_positions}" if seq > self.max_positions else None

    def _prepare_inputs(self, input, attention_mask, prepend_bos: bool | None = None,
                        padding_side: str | None = None, past: int = 0):
        """Tokens and mask, checked: a clear ValueError for anything the model cannot run. Text is
        tokenized with `prepend_bos` (default True) and padded on `padding_side` (default "right").
        `past` positions precede the tokens in a key/value cache: the length checked is the sum."""
        if isinstance(input, str) or (isinstance(input, (list, tuple)) and input and isinstance(input[0], str)):
            tokens, mask = self.to_tokens(input, prepend_bos=prepend_bos, padding_side=padding_side, return_mask=True)
            attention_mask = mask if attention_mask is None else attention_mask
            input = tokens
        if not isinstance(input, Tensor):
            raise ValueError(f"input must be a token tensor [batch seq] or text, not {type(input).__name__}")
        tokens = input
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be 2-D [batch seq], got shape {tuple(tokens.shape)}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
        if tokens.numel() == 0:
            raise ValueError(f"tokens are empty (shape {tuple(tokens.shape)}); give at least one token")
        self._check_token_ids(tokens, "token id")
        attention_mask = self._checked_mask(attention_mask, tuple(tokens.shape), tokens.device, past)
        self._check_sequence(tokens.shape[1], attention_mask, past)
        return tokens.long(), attention_mask  # uint8 and int16 ids too: the forward's annotations say signed

    def _check_sequence(self, seq: int, attention_mask: Tensor | None, past: int = 0) -> None:
        """A ValueError unless the model computes `seq` positions after `past` cached ones with this
        padding (families add rules)."""
        if past and past + seq > self.max_positions:
            raise ValueError(f"{past} cached + {seq} new positions exceed the model's {self.max_positions} positions")
        if seq > self.max_positions:
            raise ValueError(f"sequence length {seq} exceeds the model's {self.max_positions} positions")

    def _checked_mask(self, attention_mask, shape: tuple[int, ...], device, past: int = 0) -> Tensor | None:
        """The mask as long ids of 0 and 1, of the inputs' [batch seq] shape, with a real token per row
        (unless `past` cached positions precede them: the real tokens may all be there)."""
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != shape:
            got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask)
            raise ValueError(f"attention_mask has shape {got}, but the tokens are {shape}")
        self._check_mask_values(attention_mask, "attention_mask")
        if not past and bool((attention_mask.sum(-1) == 0).any()):
            raise ValueError("attention_mask has a row with no real token (all zeros)")
        return attention_mask.to(device=device, dtype=torch.long)  # bool and float masks too

    def _check_token_ids(self, tokens: Tensor, what: str) -> Tensor:
        # Checked here because nn.Embedding's IndexError (or a device assert on GPU) names neither.
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.cfg.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"{what} {bad} is outside the vocabulary [0, {self.cfg.vocab_size})")
        return tokens

    @staticmethod
    def _check_mask_values(mask: Tensor, what: str) -> Tensor:
        # Any other value would be read as "real" by some consumers and as a weight by others.
        bad = mask[(mask != 0) & (mask != 1)]
        if bad.numel():
            raise ValueError(f"{what} must hold only 0 (padding) and 1 (real token), found {bad[0].item()}")
        return mask

    # ---------------------------------------------------------------------------------- tokens
    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(
                f"this {type(self).__name__} has no tokenizer; pass token ids, or load a checkpoint "
                "directory that has tokenizer files (or set model.tokenizer)"
            )
        return self.tokenizer

    def to_tokens(self, input, prepend_bos: bool | None = True, padding_side: str | None = "right",
                  return_mask: bool = False, move_to_device: bool = True, truncate: bool = True):
        """Text -> token ids [batch seq], BOS first. A list of strings is padded on `padding_side`.
        None means the default for either (as TransformerLens, whose callers pass None through)."""
        tokenizer = self._require_tokenizer()
        prepend_bos = True if prepend_bos is None else prepend_bos
        padding_side = padding_side or "right"
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', not {padding_side!r}")
        texts = [input] if isinstance(input, str) else list(input)
        encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        _warn_unknown_words(tokenizer, texts, encoded)
        bos = getattr(tokenizer, "bos_token_id", None)
        if prepend_bos and bos is not None:
            encoded = [[bos, *ids] for ids in encoded]
        if truncate:
            encoded = [ids[: self.max_positions] for ids in encoded]
        width = max(len(ids) for ids in encoded)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (bos or 0)
        tokens = torch.full((len(encoded), width), pad, dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, ids in enumerate(encoded):
            span = slice(0, len(ids)) if padding_side == "right" else slice(width - len(ids), width)
            tokens[row, span] = torch.tensor(ids, dtype=torch.long)
            mask[row, span] = 1
        if move_to_device:
            tokens, mask = tokens.to(self.cfg.device), mask.to(self.cfg.device)
        if return_mask:
            return tokens, (None if bool(mask.all()) else mask)
        return tokens

    def to_string(self, tokens) -> str | list[str]:
        """Token ids -> text: one string for a 1-D input, a list for 2-D."""
        tokenizer = self._require_tokenizer()
        if isinstance(tokens, Tensor) and tokens.ndim == 2:
            return [tokenizer.decode(row) for row in tokens.tolist()]
        if isinstance(tokens, Tensor):
            tokens = tokens.tolist()
        return tokenizer.decode(tokens)

    def to_str_tokens(self, input, prepend_bos: bool = True) -> list[str]:
        """Each token as the text it stands for."""
        tokenizer = self._require_tokenizer()
        if isinstance(input, str):
            input = self.to_tokens(input, prepend_bos=prepend_bos)[0]
        if isinstance(input, Tensor):
            input = input.flatten().tolist() if input.ndim < 2 or input.shape[0] == 1 else input.tolist()
        return [tokenizer.decode([t]) for t in input]

    def to_single_token(self, text: str) -> int:
        """The id of a string that is exactly one token (" Paris"), else a ValueError."""
        tokens = self.to_tokens(text, prepend_bos=False)[0]
        if tokens.numel() != 1:
            raise ValueError(f"{text!r} is {tokens.numel()} tokens, not one")
        return int(tokens[0])



def _warn_unknown_words(tokenizer, texts: list[str], encoded: list[list[int]]) -> None:
    """Warn, naming them, about the words a tokenizer turned into its unknown token: the model reads
    `<unk>` there, and nothing else would show it (generate returns the prompt as it was given).
    A word-level tokenizer (the embedded models') has one for every word outside its vocabulary."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not any(unk in ids for ids in encoded):
        return
    words = []
    for text, ids in zip(texts, encoded):
        if unk not in ids:
            continue
        if getattr(tokenizer, "is_fast", False):
            spans = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            words += [text[start:end] for token, (start, end) in zip(ids, spans)
                      if token == unk and text[start:end].strip() != tokenizer.unk_token]
        else:
            words += [tokenizer.unk_token] * ids.count(unk)
    if words:
        words = list(dict.fromkeys(words))
        verb, place = ("is", "its") if len(words) == 1 else ("are", "their")
        warnings.warn(f"{', '.join(map(repr, words))} {verb} not in the tokenizer's vocabulary: the model reads "
                      f"{tokenizer.unk_token!r} (id {unk}) in {place} place", UserWarning,
                      stacklevel=_caller_level(sys._getframe()))


def _caller_level(frame) -> int:
    """The `stacklevel` of the first frame outside this package and the wrappers around its methods
    (torch's `no_grad`, jaxtyping's checks, TransformerLens's `__call__`), so that a warning raised in
    `to_tokens` points at the user's line whichever method called it. `frame` is the warning
    function's own (level 1)."""
    level = 1
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE_DIR)
                                 or frame.f_globals.get("__name__", "").partition(".")[0] in _DECORATORS):
        frame, level = frame.f_back, level + 1
    return level
