"""Generation with hooks: the loop every family shares, and the decoders in which families differ.

`GenerationMixin.generate` makes a left-padded batch of prompts, asks a *decoder* for the next-token
logits after each step, picks the next token (greedy, or sampled with temperature, top_k, top_p)
and stops each row at EOS. Hooks active on the model (`with model.hooks(...)`) or passed as
`fwd_hooks` fire at every step, so steering during generation is a hook like any other.

A family picks its decoder in `_decoder`:
- `CachedDecoder` (families with `supports_kv_cache`, Arcee): runs the prompt once, then only the
  new position, against a key/value cache. A step's hooks see the NEW POSITION ONLY ([batch 1 ...];
  the attention pattern is [batch heads 1 key], over every cached key); `lm_head_output` and
  `logits` are computed for the last position only, also while the prompt runs.
- `RecomputeDecoder` (`use_cache=False`, or a family without a cache): runs the whole sequence each
  step, so every step's hooks see every position, as TransformerLens does with use_past_kv_cache=False.
- `PaddedWindowDecoder` (alpha-er): the reference's rule, see its docstring.
In every case a value's positions are its real ones: rotary and positional embeddings count from
the row's first real token, and padding is masked out.
"""

import math
from collections.abc import Callable, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from hooked_models.components.kv_cache import KeyValueCache

RETURN_TYPES = ("input", "tokens", "str")


class RecomputeDecoder:
    """The next-token logits from a forward over the whole sequence so far."""

    def __init__(self, model):
        self.model = model
        self.max_length: int | None = model.max_positions  # prompt + new tokens must fit

    def __call__(
        self, tokens: Int[Tensor, "batch seq"], mask: Int[Tensor, "batch seq"] | None
    ) -> Float[Tensor, "batch vocab_size"]:
        # Prompts are left-padded, so every row's last real token is in the last column.
        return self.model(tokens, attention_mask=mask)[:, -1]


class CachedDecoder(RecomputeDecoder):
    """The next-token logits from a forward over the positions not yet run, with a key/value cache."""

    def __init__(self, model):
        super().__init__(model)
        self.cache = KeyValueCache()

    def __call__(
        self, tokens: Int[Tensor, "batch seq"], mask: Int[Tensor, "batch seq"] | None
    ) -> Float[Tensor, "batch vocab_size"]:
        seen = self.cache.length
        # Only the prompt can hold padding; generated positions are real (mask None: all ones).
        new_mask = mask[:, seen:] if mask is not None and seen == 0 else None
        logits = self.model(tokens[:, seen:], attention_mask=new_mask, past_kv_cache=self.cache, logits_to_keep=1)
        return logits[:, -1]


class PaddedWindowDecoder:
    """The rule of a model trained at one sequence length (alpha-er's reference `generate`).

    Each row's last `block_size` real tokens are padded AFTER the text with `pad_id` up to
    `block_size`, the model runs on the whole window, and the logits are read at the last real
    position; causal attention keeps the padding from influencing them. Prompts longer than
    `block_size` are allowed: the window slides.
    """

    def __init__(self, model, block_size: int, pad_id: int = 0):
        self.model, self.block_size, self.pad_id = model, block_size, pad_id
        self.max_length: int | None = None

    def __call__(
        self, tokens: Int[Tensor, "batch seq"], mask: Int[Tensor, "batch seq"] | None
    ) -> Float[Tensor, "batch vocab_size"]:
        batch = tokens.shape[0]
        rows = list(tokens) if mask is None else [row[keep.bool()] for row, keep in zip(tokens, mask)]
        windows = [row[-self.block_size:] for row in rows]
        padded = torch.full((batch, self.block_size), self.pad_id, dtype=tokens.dtype, device=tokens.device)
        for i, window in enumerate(windows):
            padded[i, : len(window)] = window
        last = torch.tensor([len(w) - 1 for w in windows], device=tokens.device)
        return self.model(padded)[torch.arange(batch, device=tokens.device), last]


def pick_next_tokens(
    logits: Float[Tensor, "batch vocab_size"],
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Int[Tensor, " batch"]:
    """The next token of each row: the argmax at temperature 0, else one draw.

    The draw is the alpha-er reference's: the `top_k` largest logits, divided by the temperature,
    softmaxed, then one `torch.multinomial` over those k (transformers masks the rest of the
    vocabulary instead: the same distribution, another use of the random stream). `top_p` keeps
    the smallest prefix of those, by falling probability, whose mass reaches top_p (nucleus).
    """
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    if top_k is None and top_p is None:
        probs = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    values, indices = torch.topk(logits, min(top_k or logits.shape[-1], logits.shape[-1]))
    probs = torch.softmax(values / temperature, dim=-1)
    if top_p is not None and top_p < 1:
        # A token stays if the mass before it is short of top_p; the most likely always stays.
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
    return indices.gather(-1, torch.multinomial(probs, 1, generator=generator))[:, 0]


class GenerationMixin:
    """`generate` for a HookedModel; a family chooses its decoder by overriding `_decoder`."""

    def _decoder(self, use_cache: bool):
        """The family's next-token rule: with a key/value cache where the family has one."""
        if use_cache and self.supports_kv_cache:
            return CachedDecoder(self)
        return RecomputeDecoder(self)

    def apply_chat_template(self, conversation) -> list[str]:
        """Render prompts with the tokenizer's chat template, ready for the assistant's turn.

        `conversation` is a message (str, the user's turn), a list of messages, one conversation
        (a list of {"role", "content"} dicts) or a list of conversations. AFM-4.5B's template is
        ChatML and adds its default system turn when the conversation has none.
        """
        tokenizer = self._require_tokenizer()
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template (chat_template is None); "
                             "pass the prompt as plain text with chat=False")
        if isinstance(conversation, str):
            conversations = [[{"role": "user", "content": conversation}]]
        elif conversation and all(isinstance(c, str) for c in conversation):
            conversations = [[{"role": "user", "content": c}] for c in conversation]
        elif conversation and all(isinstance(c, dict) for c in conversation):
            conversations = [list(conversation)]
        elif conversation and all(isinstance(c, (list, tuple)) for c in conversation):
            conversations = [list(c) for c in conversation]
        else:
            raise ValueError("a chat prompt is a string, a list of strings, a conversation (a list of "
                             f"{{'role', 'content'}} dicts) or a list of conversations, not {conversation!r}")
        return [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]

    @torch.no_grad()
    def generate(
        self,
        input: str | list[str] | Tensor | list,
        max_new_tokens: int = 10,
        temperature: float | int = 1.0,
        top_k: int | None = None,
        top_p: float | int | None = None,
        do_sample: bool = True,
        stop_at_eos: bool = True,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int | None = None,
        attention_mask: Tensor | None = None,
        fwd_hooks: Sequence[tuple[str | Callable, Callable]] = (),
        use_cache: bool = True,
        chat: bool = False,
        prepend_bos: bool = True,
        return_type: str = "input",
        verbose: bool | None = None,
    ):
        """Continue each prompt by up to `max_new_tokens` tokens.

        input: a string, a list of strings (left-padded into one batch), or token ids [batch seq]
            or [seq] (with `attention_mask` where they are padded, on either side).
        temperature: 0 (or `do_sample=False`) picks the argmax; otherwise tokens are drawn from
            softmax(logits / temperature), restricted to the `top_k` most likely and to the nucleus
            of mass `top_p` when given (see `pick_next_tokens`).
        stop_at_eos: a row that produced an EOS (`eos_token_id`, else the config's and the
            tokenizer's) is filled with the pad token from then on; generation ends when every row has.
        seed: draws come from a generator seeded with it; without it, from torch's global stream.
        fwd_hooks: [(name, hook)] active for the whole generation (as in `model.hooks`) and
            removed afterwards, also when a hook raises. Hooks already active on the model apply too.
        use_cache: decode with a key/value cache where the family has one. A step's hooks then see
            the new position only; with use_cache=False they see the whole sequence every step.
            Either way positions are real: counted from each row's first token, padding masked.
        chat: render the input with the tokenizer's chat template first (`apply_chat_template`).
        return_type: "tokens" (prompt, left-padded, and continuation: [batch seq], also for a
            [seq] input), "str" (each prompt's text followed by its continuation's: a string for
            one prompt, a list for a list), or "input" (text for text, tokens for tokens).
        verbose: a progress bar; None shows one only for generations that last over a second on
            an interactive terminal, False never, True always.
        """
        _check_arguments(max_new_tokens, temperature, top_k, top_p, return_type)
        one_prompt = isinstance(input, str) or (isinstance(input, Tensor) and input.ndim == 1) or (
            chat and isinstance(input, (list, tuple)) and bool(input) and all(isinstance(m, dict) for m in input))
        if chat:
            input, prepend_bos = self.apply_chat_template(input), False
        tokens, mask, texts = self._generation_prompts(input, attention_mask, prepend_bos)
        decoder = self._decoder(use_cache)
        prompt_length = tokens.shape[1]
        limit = decoder.max_length
        if limit is not None and prompt_length > limit:
            raise ValueError(f"the prompt is {prompt_length} tokens, longer than the {limit} positions "
                             f"{type(self).__name__} allows")
        if limit is not None and prompt_length + max_new_tokens > limit:
            raise ValueError(f"the prompt ({prompt_length} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"the {limit} positions {type(self).__name__} allows; "
                             f"use max_new_tokens <= {limit - prompt_length}")

        eos = self._eos_ids(eos_token_id) if stop_at_eos else None
        eos = None if eos is None else torch.tensor(eos, device=tokens.device)
        pad = self._pad_id()
        generator = None if seed is None else torch.Generator(device=tokens.device).manual_seed(seed)
        finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        temperature = float(temperature) if do_sample else 0.0
        bar = tqdm(total=max_new_tokens, desc="generate", unit="token", leave=False,
                   disable=None if verbose is None else not verbose, delay=1.0 if verbose is None else 0.0)
        with self.hooks(fwd_hooks=list(fwd_hooks)), bar:
            for _ in range(max_new_tokens):
                logits = decoder(tokens, mask)
                next_tokens = pick_next_tokens(logits, temperature, top_k, top_p, generator)
                if eos is not None:
                    next_tokens = torch.where(finished, torch.full_like(next_tokens, pad), next_tokens)
                    finished = finished | torch.isin(next_tokens, eos)
                tokens = torch.cat([tokens, next_tokens[:, None]], dim=1)
                if mask is not None:
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                bar.update()
                if eos is not None and bool(finished.all()):
                    break

        if return_type == "tokens" or (return_type == "input" and texts is None):
            return tokens
        text = self._generated_text(tokens, mask, prompt_length, texts, eos)
        return text[0] if one_prompt else text

    # ------------------------------------------------------------------------------ helpers
    def _generation_prompts(self, input, attention_mask, prepend_bos):
        """(left-padded tokens [batch seq], their mask or None when unpadded, the texts or None)."""
        if isinstance(input, str) or (isinstance(input, (list, tuple)) and input
                                      and all(isinstance(t, str) for t in input)):
            texts = [input] if isinstance(input, str) else list(input)
            # Not truncated: a prompt longer than the model allows gets a clear error instead.
            tokens, mask = self.to_tokens(texts, prepend_bos=prepend_bos, padding_side="left",
                                          return_mask=True, truncate=False)
            return tokens, mask, texts
        if not isinstance(input, Tensor):
            raise ValueError(f"input must be a string, a list of strings or token ids, not {type(input).__name__}")
        tokens = input[None] if input.ndim == 1 else input
        if tokens.ndim != 2 or tokens.shape[1] == 0 or tokens.shape[0] == 0:
            raise ValueError(f"tokens must be [seq] or [batch seq] with at least one token, got {tuple(input.shape)}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.cfg.vocab_size:
            raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if attention_mask is None:
            return tokens, None, None
        mask = attention_mask[None] if attention_mask.ndim == 1 else attention_mask
        if tuple(mask.shape) != tuple(tokens.shape):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, "
                             f"but the tokens are {tuple(input.shape)}")
        mask = mask.to(tokens.device).long()
        real = mask.sum(-1)
        if bool((real == 0).any()):
            raise ValueError("attention_mask has a row with no real token (all zeros)")
        # Left-justify: padding first, each row's real tokens in order at the end (a stable sort).
        order = torch.sort(mask, dim=1, stable=True).indices
        width = int(real.max())
        tokens, mask = tokens.gather(1, order)[:, -width:], mask.gather(1, order)[:, -width:]
        return tokens, (None if bool(mask.bool().all()) else mask), None

    def _eos_ids(self, eos_token_id) -> list[int] | None:
        """The ids that end a row: those given, else the config's and the tokenizer's together (a chat
        checkpoint's tokenizer may end a turn with a token the config does not list)."""
        sources = [eos_token_id] if eos_token_id is not None else [
            getattr(self.cfg, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)]
        ids = [int(i) for s in sources if s is not None for i in ([s] if isinstance(s, int) else s)]
        return list(dict.fromkeys(ids)) or None

    def _pad_id(self) -> int:
        """What fills a finished row: the pad token, else the first EOS, else 0 (transformers' order)."""
        for source in (getattr(self.cfg, "pad_token_id", None), getattr(self.tokenizer, "pad_token_id", None),
                       self._eos_ids(None)):
            if source is not None:
                return source if isinstance(source, int) else source[0]
        return 0

    def _generated_text(self, tokens, mask, prompt_length, texts, eos) -> list[str]:
        tokenizer = self._require_tokenizer()
        eos_ids = set() if eos is None else set(eos.tolist())
        out = []
        for row in range(tokens.shape[0]):
            prompt = tokens[row, :prompt_length]
            if mask is not None:
                prompt = prompt[mask[row, :prompt_length].bool()]
            new = tokens[row, prompt_length:].tolist()
            if eos is not None:
                # Up to and including the row's EOS; what follows is the pad filling a finished row.
                stop = next((i for i, t in enumerate(new) if t in eos_ids), len(new) - 1)
                new = new[: stop + 1]
            ids = prompt.tolist()
            full = tokenizer.decode(ids + new, skip_special_tokens=True)
            # As transformers' text-generation pipeline: the prompt verbatim, then what decoding added.
            prompt_text = texts[row] if texts is not None else tokenizer.decode(ids, skip_special_tokens=True)
            out.append(prompt_text + full[len(tokenizer.decode(ids, skip_special_tokens=True)):])
        return out


def _check_arguments(max_new_tokens, temperature, top_k, top_p, return_type) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type must be one of {RETURN_TYPES}, not {return_type!r}")
