"""`HookedModel`, the root of every hooked model: its mixins, the printout's support table, the TransformerLens
module views, and the forward with its edges (`start_at_layer`, `stop_at_layer`, a key/value cache)."""

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor
from transformer_lens import HookedRootModule

from hooked_models.components.kv_cache import KeyValueCache
from hooked_models.devices import resolve_device
from hooked_models.dtypes import is_dtype_name, resolve_dtype
from hooked_models.generation import GenerationMixin
from hooked_models.hooks import HookedModule, ValueHook
from hooked_models.model.caching import Caching
from hooked_models.model.inputs import Inputs
from hooked_models.model.names import HookNames
from hooked_models.saes import SAEMixin
from hooked_models.transformer_lens_compat import TransformerLensModel
from hooked_models.vocabulary import Support, SupportRow


class HookedModel(HookNames, Caching, Inputs, SAEMixin, GenerationMixin, TransformerLensModel, HookedModule,
                  HookedRootModule):
    """Shared root of HookedArcee and HookedAlphaEr. Its names and hooks come from model/names.py, the cache
    from model/caching.py, tokens and input checks from model/inputs.py (these first, so they override
    TransformerLens's); `generate` from hooked_models/generation.py, TransformerLens's model surface from
    hooked_models/transformer_lens_compat.py, SAE splicing (`add_sae`, `run_with_saes`, ...) from
    hooked_models/saes.py.

    A family builds its modules (`embed_tokens`, `layers`, `norm`, `lm_head`) and the root
    ValueHooks, calls `setup()`, and defines the two steps of the forward in which families differ:
    `_embed(tokens, past)`, the residual stream entering the first layer (`past` positions precede
    the tokens, held by a key/value cache), and `_attention_inputs(batch, seq, attention_mask, device,
    dtype, past_kv_cache)`, what every layer's attention needs for the call (mask, rotary). The
    shared `forward` checks the inputs and runs the layers and the unembedding around them.
    """

    tokenizer: Any = None
    # Whether the forward takes `past_kv_cache` and `logits_to_keep`: incremental decoding.
    supports_kv_cache = False

    def __init__(self):
        super().__init__()
        self.aliases: dict[str, str] = {}

    def to(self, *args, **kwargs):
        """`nn.Module.to`, taking dtype names too ("bfloat16", "bf16", "fp16": hooked_models.dtypes) and
        checking the device (a clear error for "cuda" without CUDA); `cfg.dtype` and `cfg.device` follow."""
        args = [resolve_dtype(a) if isinstance(a, str) and is_dtype_name(a)
                else resolve_device(a) if isinstance(a, (str, torch.device)) else a for a in args]
        if kwargs.get("dtype") is not None:
            kwargs["dtype"] = resolve_dtype(kwargs["dtype"])
        if kwargs.get("device") is not None:
            kwargs["device"] = resolve_device(kwargs["device"])
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        super().to(*args, **kwargs)
        cfg = getattr(self, "cfg", None)
        if cfg is not None and dtype is not None:
            cfg.dtype = dtype
        if cfg is not None and device is not None:
            cfg.device = device
        return self

    # ----------------------------------------------------------------------------------- views
    def support(self) -> Support:
        """The table of values this model exposes, by host module: name, layout, meaning, where read."""
        rows = []
        for name, point in self.standard_hook_dict.items():
            if not isinstance(point, ValueHook):
                continue
            value = point.value
            aliases = self._alias_names.get(name, [])
            rows.append(SupportRow(value.host, name.rpartition(".")[0] or type(self).__name__, name,
                                   value.layout_text, value.meaning, value.read_at,
                                   aliases[0] if aliases else None))
        return Support(rows)

    @property
    def blocks(self):
        """TransformerLens's name for the layers (read-only view)."""
        return self.layers

    @property
    def ln_final(self):
        return self.norm

    @property
    def unembed(self):
        return self.lm_head

    @property
    def embed(self):
        return self.embed_tokens

    # --------------------------------------------------------------------------------- forward
    def forward(
        self,
        input,
        attention_mask: Tensor | None = None,
        return_type: str | None = "logits",
        *,
        loss_per_token: bool = False,
        prepend_bos: bool | None = None,
        padding_side: str | None = None,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        tokens: Tensor | None = None,
        past_kv_cache: KeyValueCache | None = None,
        logits_to_keep: int = 0,
    ):
        """Logits [batch seq vocab_size] for tokens [batch seq] (or text, through the tokenizer).

        `attention_mask` marks real tokens with 1 and padding with 0, on either side; each row's
        positions count from its first real token. `return_type` is "logits", "loss" (mean next-token
        cross-entropy over real tokens; [batch seq-1] per token with `loss_per_token`, zero where the
        next token is padding), "both" ((logits, loss)) or None. Text is tokenized with `prepend_bos`
        (default True) and padded on `padding_side` (default "right"); both are ignored for token ids.

        TransformerLens's partial runs: `stop_at_layer=k` runs the layers below k only and returns
        the residual stream entering layer k (`layers.{k}.layer_input`; k = num_layers gives the
        stream entering the final norm; negative k counts from the end), whatever `return_type`.
        `start_at_layer=k` takes that stream as `input` ([batch seq hidden_size]) and runs the rest:
        `tokens=` (needed for a loss) and `attention_mask=` give its tokens and padding. Both are
        exact: the stream `stop_at_layer=k` returns, fed to `start_at_layer=k`, gives the full run's
        logits bit for bit.

        `past_kv_cache` (families with `supports_kv_cache`) holds the earlier positions: `tokens` and
        `attention_mask` are then the new positions only, and the cache grows by them; positions,
        rotary, mask (and alpha-er's expert routing) continue after the cached ones. With
        `start_at_layer` the input is the new positions' residual stream: a window of another run
        whose keys and values `KeyValueCache.prefilled` holds (activation patching's partial runs). `logits_to_keep`
        > 0 (same families) computes the logits of the last that many positions only, as generation
        needs: `lm_head_output`, `logits` and `next_token_probs` then cover those positions.
        """
        start, stop = self._layer_range(start_at_layer, stop_at_layer)
        if past_kv_cache is not None and not self.supports_kv_cache:
            raise ValueError(f"{type(self).__name__} does not support a key/value cache")
        past = 0 if past_kv_cache is None else past_kv_cache.length
        if start_at_layer is None:
            if tokens is not None:
                raise ValueError("tokens= goes with start_at_layer (the input is then the residual stream); "
                                 "pass the tokens as the input")
            tokens, attention_mask = self._prepare_inputs(input, attention_mask, prepend_bos, padding_side, past)
            residual, (batch, seq) = None, tokens.shape
        else:
            residual, tokens, attention_mask = self._prepare_residual(input, tokens, attention_mask, start_at_layer,
                                                                      past)
            batch, seq = residual.shape[:2]
        if return_type in ("loss", "both") and tokens is None and stop is None:
            raise ValueError(f"return_type={return_type!r} needs the tokens: pass tokens= with start_at_layer")
        if logits_to_keep:
            if not self.supports_kv_cache:
                raise ValueError(f"{type(self).__name__} does not support logits_to_keep")
            if return_type not in ("logits", None):
                raise ValueError(f"return_type={return_type!r} needs every position's logits; "
                                 "drop logits_to_keep")
        if tokens is not None:
            tokens = self.input_ids(tokens)
            if self.input_ids.has_hooks():  # a hook may have written ids the embedding cannot look up
                self._check_token_ids(tokens, "a hook on input_ids wrote token id")
        if attention_mask is None and self.attention_mask.has_hooks():
            attention_mask = torch.ones(batch, seq, dtype=torch.long, device=self.cfg.device if tokens is None
                                        else tokens.device)
        if attention_mask is not None:
            attention_mask = self.attention_mask(attention_mask)
            if self.attention_mask.has_hooks():
                self._check_mask_values(attention_mask, "a hook on attention_mask wrote a mask that")
        if self.input_size.has_hooks():
            self.input_size(torch.tensor((batch, seq)))
        x = self._embed(tokens, past) if residual is None else residual
        inputs = self._attention_inputs(batch, seq, attention_mask, x.device, x.dtype, past_kv_cache)
        for layer in self.layers[start:stop]:
            x = layer(x, inputs)
        if stop is not None:
            return x
        logits = self.logits(self._unembed(x, logits_to_keep))
        if self.next_token_probs.has_hooks():
            kept = attention_mask if attention_mask is None else attention_mask[:, -logits.shape[1]:]
            self.next_token_probs(self._next_token_probs(logits, kept))
        if return_type is None:
            return None
        if return_type == "logits":
            return logits
        loss = self.loss(logits, tokens, attention_mask, per_token=loss_per_token)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits, loss
        raise ValueError(f"return_type must be 'logits', 'loss', 'both' or None, not {return_type!r}")

    def _unembed(self, x: Float[Tensor, "batch seq hidden_size"], logits_to_keep: int = 0) -> Tensor:
        """The final norm and the unembedding (of the last `logits_to_keep` positions only, when > 0)."""
        x = self.final_norm_output(self.norm(x))
        if logits_to_keep:
            # As transformers' logits_to_keep: generation reads one position, not the prompt's vocab_size each.
            x = x[:, -logits_to_keep:]
        return self.lm_head_output(self.lm_head(x))

    def _layer_range(self, start_at_layer: int | None, stop_at_layer: int | None) -> tuple[int, int | None]:
        """(first layer to run, layer to stop before or None for all): TransformerLens's arguments,
        checked, negative values counted from the end."""
        n = self.cfg.num_layers
        bounds = {}
        for name, layer in (("start_at_layer", start_at_layer), ("stop_at_layer", stop_at_layer)):
            if layer is None:
                continue
            if isinstance(layer, bool) or not isinstance(layer, int) or not -n <= layer <= n:
                raise ValueError(f"{name}={layer!r} must be an integer layer index in [{-n}, {n}] "
                                 f"(the model has {n} layers; negative counts from the end)")
            bounds[name] = layer % n if layer < 0 else layer
        start, stop = bounds.get("start_at_layer", 0), bounds.get("stop_at_layer")
        if stop is not None and stop < start:
            raise ValueError(f"stop_at_layer={stop_at_layer} comes before start_at_layer={start_at_layer}")
        return start, stop

    def _prepare_residual(self, input, tokens, attention_mask, start_at_layer, past: int = 0):
        """(residual, tokens or None, mask) for a run that starts at a layer, checked (`past`
        positions precede them in a key/value cache)."""
        if not isinstance(input, Tensor) or input.ndim != 3 or not input.is_floating_point():
            got = f"shape {tuple(input.shape)} {input.dtype}" if isinstance(input, Tensor) else type(input).__name__
            raise ValueError(f"with start_at_layer={start_at_layer} the input is the residual stream "
                             f"[batch seq hidden_size] (floating point), not {got}")
        if input.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"the residual stream has width {input.shape[-1]}, but the model's hidden_size is "
                             f"{self.cfg.hidden_size}")
        if tokens is not None:
            tokens, attention_mask = self._prepare_inputs(tokens, attention_mask, past=past)
            if tuple(tokens.shape) != tuple(input.shape[:2]):
                raise ValueError(f"tokens have shape {tuple(tokens.shape)}, but the residual stream is "
                                 f"{tuple(input.shape[:2])} positions")
        else:
            # As _prepare_inputs: the mask checked first, so a family's sequence rule reads a checked mask.
            attention_mask = self._checked_mask(attention_mask, tuple(input.shape[:2]), input.device, past)
            self._check_sequence(input.shape[1], attention_mask, past)
        return input, tokens, attention_mask

    @staticmethod
    def _next_token_probs(logits: Tensor, attention_mask: Tensor | None) -> Float[Tensor, "batch vocab_size"]:
        if attention_mask is None:
            last = logits[:, -1]
        else:
            # The last real position of each row, whichever side the padding is on.
            positions = torch.arange(logits.shape[1], device=logits.device)
            index = (attention_mask.bool() * (positions + 1)).argmax(-1)
            last = logits[torch.arange(logits.shape[0], device=logits.device), index]
        return last.float().softmax(-1)

    @staticmethod
    def loss(logits: Tensor, tokens: Tensor, attention_mask: Tensor | None = None, per_token: bool = False) -> Tensor:
        """Mean next-token cross-entropy, over positions whose next token is real; with `per_token`,
        each position's [batch seq-1], zero where it or the next token is padding (TransformerLens's)."""
        losses = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        losses = losses.view(tokens.shape[0], -1)
        keep = None if attention_mask is None else (attention_mask[:, 1:] * attention_mask[:, :-1]).to(losses.dtype)
        if per_token:
            return losses if keep is None else losses * keep
        if keep is None:
            return losses.mean()
        return (losses * keep).sum() / keep.sum()
