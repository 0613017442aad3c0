"""The root of every hooked model: names, hooks, the cache, the printout and the forward's edges.

A family subclasses `HookedModel`, builds its modules, calls `setup()`, and implements `_embed` and
`_attention_inputs`.
Everything a user touches by name goes through `resolve_hook_name`, which accepts the standard name
(`layers.0.self_attn.attention_queries`) or the TransformerLens one (`blocks.0.attn.hook_rot_q`) and
maps the second onto the first: one HookPoint per value, an alias is only a second name.
"""

import difflib
import os
import re
import sys
import warnings
from functools import partial
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint, _AliasedHookPoint
from transformer_lens.utilities import Slice

from hooked_models.cache import HookedActivationCache
from hooked_models.components.kv_cache import KeyValueCache
from hooked_models.devices import resolve_device
from hooked_models.dtypes import is_dtype_name, resolve_dtype
from hooked_models.generation import GenerationMixin
from hooked_models.hooks import HookedModule, UnknownHookError, ValueHook, check_hook_write
from hooked_models.saes import SAEMixin
from hooked_models.transformer_lens_compat import TransformerLensModel
from hooked_models.vocabulary import SYNONYMS, Support, SupportRow, Value, tl_module_path


# Position axis marker for a spliced SAE's HookPoints: the axis after the batch, whatever their rank.
_SECOND_AXIS = "second"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_DECORATORS = {"torch", "jaxtyping", "beartype", "transformer_lens"}   # wrappers around our methods


class _AliasHook:
    """A user's hook added under a TransformerLens name: it sees that name and that layout,
    and what it returns is mapped back to the standard layout. (A HookPoint that carries no value,
    a spliced SAE's, has one layout: the hook only sees the name.)"""

    def __init__(self, fn: Callable, alias: str, value: Value | None):
        self.fn, self.alias, self.value = fn, alias, value

    def __repr__(self) -> str:
        return repr(self.fn)

    def __call__(self, tensor: Tensor, *, hook: HookPoint):
        if self.value is None:
            return self.fn(tensor, hook=_AliasedHookPoint(self.alias, hook))
        given = self.value.to_tl(tensor)
        out = self.fn(given, hook=_AliasedHookPoint(self.alias, hook))
        if out is None:
            return None
        # Checked in the layout the user saw, before einops could fail on a wrong shape.
        check_hook_write(out, given, f"{self.alias!r} (standard name {hook.name!r})", self.value)
        return self.value.from_tl(out)


class HookedModel(SAEMixin, GenerationMixin, TransformerLensModel, HookedModule, HookedRootModule):
    """Shared root of HookedArcee and HookedAlphaEr; `generate` comes from hooked_models/generation.py,
    TransformerLens's model surface from hooked_models/transformer_lens_compat.py, SAE splicing
    (`add_sae`, `run_with_saes`, ...) from hooked_models/saes.py.

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

    # ----------------------------------------------------------------------------------- names
    def setup(self):
        """Index every HookPoint by its standard name and every alias by its TransformerLens name.

        Call at the end of `__init__`, and again after replacing a submodule.
        """
        super().setup()
        # hook_dict answers to both names (TransformerLens code iterates it for "...hook_z" names);
        # standard_hook_dict holds each HookPoint once, under its standard name.
        self.standard_hook_dict: dict[str, HookPoint] = dict(self.hook_dict)
        self.aliases = {}
        for name, point in self.standard_hook_dict.items():
            value = getattr(point, "value", None)
            if value is None or value.tl is None:
                continue
            module_path = name.rpartition(".")[0]
            host = module_path.rpartition(".")[0] if value.tl_on_parent else module_path
            hosts = [host, host.rpartition(".")[0]] if value.tl_also_on_parent else [host]
            for tl_host in map(tl_module_path, hosts):
                if tl_host is not None:
                    self.aliases[f"{tl_host}.{value.tl}" if tl_host else value.tl] = name
        self._tl_fallback_aliases()
        # HookPoints under a value (a spliced SAE's) answer under each of its names too.
        for name in self.standard_hook_dict:
            parent, _, leaf = name.rpartition(".")
            if not isinstance(self.standard_hook_dict.get(parent), ValueHook):
                continue
            for alias in [a for a, c in self.aliases.items() if c == parent]:
                self.aliases[f"{alias}.{leaf}"] = name
        self._alias_names: dict[str, list[str]] = {}
        for alias, canonical in self.aliases.items():
            self._alias_names.setdefault(canonical, []).append(alias)
        self.hook_dict = {**self.standard_hook_dict,
                          **{alias: self.standard_hook_dict[c] for alias, c in self.aliases.items()}}

    def resolve_hook_name(self, name: str) -> tuple[str, Value | None]:
        """(standard name, the Value whose layout an alias converts, or None where none is needed)."""
        if name in self.standard_hook_dict:
            return name, None
        if name in self.aliases:
            canonical = self.aliases[name]
            value = getattr(self.standard_hook_dict[canonical], "value", None)
            return canonical, value if value is not None and value.tl_layout else None
        raise UnknownHookError(f"no hook named {name!r} on {type(self).__name__}{self._name_hint(name)}")

    def _name_hint(self, name: str) -> str:
        """The values a name means: a synonym's (vocabulary.SYNONYMS: `pattern`, `resid_pre`,
        `attentions_output`), else the nearest standard or TransformerLens names, compared with the layer
        index set aside, so a typo in layer 3 suggests layer 3's names and a shorthand suggests its hook."""
        layered = re.compile(r"^(layers|blocks)\.(\d+)\.")
        names = list(self.hook_dict)
        num_layers = 1 + max((int(m.group(2)) for n in names if (m := layered.match(n))), default=-1)
        templates = list(dict.fromkeys(layered.sub(r"\1.{i}.", n) for n in names))
        match = layered.match(name)
        if match and int(match.group(2)) >= num_layers:
            return f": layer {match.group(2)} is out of range, the model has {num_layers} layers (0 to {num_layers - 1})"
        layer = match.group(2) if match else "0"
        meant = self._synonym_names(name.rpartition(".")[2].removeprefix("hook_").lower(), layer)
        if meant:
            shown = [f"{n!r}" + (f" (TransformerLens {self._alias_names[n][0]!r})" if n in self._alias_names else "")
                     for n in meant]
            return f"; did you mean {' or '.join(shown)}?"
        query = layered.sub(r"\1.{i}.", name)
        close = difflib.get_close_matches(query, templates, n=3, cutoff=0.6)
        if not close and "." not in name:
            # A bare TransformerLens hook ("resid_pre", "hook_z"): match it against the last part of each name.
            tails = {t.rpartition(".")[2].removeprefix("hook_"): t for t in templates}
            close = [tails[t] for t in difflib.get_close_matches(name.removeprefix("hook_"), tails, n=3, cutoff=0.75)]
        close = [c.replace("{i}", layer) for c in close]
        return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""

    def _synonym_names(self, word: str, layer: str) -> list[str]:
        """Up to three names of the value a synonym means, those of `layer` where the value is per layer,
        those TransformerLens also has first (a residual norm's scale before a bottleneck's)."""
        for value_name in SYNONYMS.get(word, ()):
            found = [n for n, point in self.standard_hook_dict.items()
                     if getattr(point, "value", None) is not None and point.value.name == value_name
                     and (not n.startswith("layers.") or n.startswith(f"layers.{layer}."))]
            if found:
                return sorted(found, key=lambda n: n not in self._alias_names)[:3]
        return []

    def hook_names(self, name: str) -> list[str]:
        """Every name a HookPoint answers to: its standard name first, then its aliases."""
        return [name, *self._alias_names.get(name, [])]

    def filter_matches(self, names_filter: Callable[[str], bool]) -> Callable[[str], str | None]:
        """The rule for a filter on names (a `names_filter`, or a filter in `fwd_hooks` or `add_hook`).

        A value answers to its standard name and to its TransformerLens names, and the filter is asked
        about each. A filter that turns down a name no model has (an inclusion filter, such as
        `lambda n: n.endswith("hook_z")`) selects a value if it accepts any of its names; a filter that
        accepts such a name (an exclusion filter, such as `lambda n: not n.endswith("attention_scores")`)
        selects it only if it accepts all of them. So a filter written in either naming selects the same
        values: the other naming can neither add a value it excludes nor drop one it names.

        Returns: standard name -> the name the value matched under (the standard name, or the
        TransformerLens name an inclusion filter accepted first), or None.
        """
        excludes = bool(names_filter(""))  # "" is no model's name

        def match(canonical: str) -> str | None:
            names = self.hook_names(canonical)
            accepted = [n for n in names if names_filter(n)]
            if excludes:
                return canonical if len(accepted) == len(names) else None
            return accepted[0] if accepted else None

        return match

    def _matching_points(self, name: str | Callable[[str], bool]):
        """(HookPoint, standard name, alias or None) for a name or a filter on names."""
        if isinstance(name, str):
            canonical, _ = self.resolve_hook_name(name)
            yield self.standard_hook_dict[canonical], canonical, (name if name != canonical else None)
            return
        match = self.filter_matches(name)
        for canonical, point in self.standard_hook_dict.items():
            matched = match(canonical)
            if matched is not None:
                yield point, canonical, (matched if matched != canonical else None)

    def _wrap_for_alias(self, hook: Callable, canonical: str, alias: str | None) -> Callable:
        if alias is None:
            return hook
        return _AliasHook(hook, alias, getattr(self.standard_hook_dict[canonical], "value", None))

    # ----------------------------------------------------------------------------------- hooks
    def add_hook(self, name, hook, dir="fwd", is_permanent=False, level=None, prepend=False) -> None:
        """Add a hook by standard name, TransformerLens name, or a filter on names."""
        for point, canonical, alias in list(self._matching_points(name)):
            self.check_and_add_hook(point, canonical, self._wrap_for_alias(hook, canonical, alias), dir=dir,
                                    is_permanent=is_permanent, level=level, prepend=prepend)

    def _enable_hook(self, name, hook, dir) -> None:
        for point, canonical, alias in list(self._matching_points(name)):
            point.add_hook(self._wrap_for_alias(hook, canonical, alias), dir=dir, level=self.context_level)

    def get_caching_hooks(self, names_filter=None, incl_bwd=False, device=None, remove_batch_dim=False,
                          cache=None, pos_slice=None):
        """Hooks that store each selected value under its standard name.

        `names_filter` is a name, a list of names (standard or TransformerLens), or a function of a name,
        applied by `filter_matches`'s rule (an inclusion filter takes a value it accepts under any of its
        names, an exclusion filter only one it accepts under all of them). `pos_slice` slices each value's
        own position axis, read from its layout. With no filter, every value is cached but the on-request
        ones (per-head results, split inputs), unless their switch asked for them
        (`set_use_attn_result(True)`, `set_use_split_qkv_input(True)`, ...).
        """
        cache = {} if cache is None else cache
        pos_slice = Slice.unwrap(pos_slice)
        if names_filter is None:
            def selected(name: str) -> bool:
                value = getattr(self.standard_hook_dict[name], "value", None)
                return value is None or not value.on_request or bool(getattr(self.cfg, value.on_request, False))
        elif isinstance(names_filter, str):
            selected = {self.resolve_hook_name(names_filter)[0]}.__contains__
        elif isinstance(names_filter, (list, tuple, set)):
            selected = {self.resolve_hook_name(n)[0] for n in names_filter}.__contains__
        elif callable(names_filter):
            match = self.filter_matches(names_filter)
            selected = lambda name: match(name) is not None  # noqa: E731
        else:
            raise ValueError(f"names_filter must be a name, a list of names or a function, not {names_filter!r}")
        self.is_caching = True

        def save(tensor: Tensor, hook: HookPoint, name: str, seq_axis: int | str | None):
            stored = tensor.detach()
            if seq_axis == _SECOND_AXIS:  # a spliced SAE's [batch pos ...]
                seq_axis = 1 - stored.ndim
            if device is not None:
                stored = stored.to(device)
            if remove_batch_dim and stored.ndim > 0 and stored.shape[0] == 1:
                stored = stored[0]
            if seq_axis is not None and pos_slice.mode != "identity":
                stored = pos_slice.apply(stored, dim=seq_axis)
            cache[name] = stored

        fwd, bwd = [], []
        for name, point in self.standard_hook_dict.items():
            if not selected(name):
                continue
            if isinstance(point, ValueHook):
                seq_axis = point.value.seq_axis
            else:
                parent = self.standard_hook_dict.get(name.rpartition(".")[0])
                seq_axis = _SECOND_AXIS if isinstance(parent, ValueHook) else None
            fwd.append((name, partial(save, name=name, seq_axis=seq_axis)))
            if incl_bwd:
                bwd.append((name, partial(save, name=name + "_grad", seq_axis=seq_axis)))
        return cache, fwd, bwd

    def run_with_cache(self, *model_args, names_filter=None, device=None, remove_batch_dim=False,
                       incl_bwd=False, reset_hooks_end=True, clear_contexts=False, pos_slice=None,
                       return_cache_object=True, **model_kwargs):
        """Run the model and return (output, cache): an ActivationCache keyed by standard names.

        `incl_bwd=True` also caches each value's gradient (`name + "_grad"`) by backpropagating what the
        model returns, which must then be a scalar, as in TransformerLens:
        `run_with_cache(tokens, return_type="loss", incl_bwd=True)`. For another metric, add backward hooks
        (`run_with_hooks(..., bwd_hooks=...)`) or use `patching.attribution_patch`.
        """
        cache_dict, fwd, bwd = self.get_caching_hooks(names_filter, incl_bwd, device, remove_batch_dim,
                                                      pos_slice=pos_slice)
        with self.hooks(fwd_hooks=fwd, bwd_hooks=bwd, reset_hooks_end=reset_hooks_end,
                        clear_contexts=clear_contexts):
            out = self(*model_args, **model_kwargs)
            if incl_bwd:
                if not (isinstance(out, Tensor) and out.numel() == 1):
                    got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
                    raise ValueError(
                        f"incl_bwd=True backpropagates what the model returns, which must be a scalar, but it "
                        f"returned {got}; pass return_type=\"loss\" (the mean next-token loss), as in "
                        "TransformerLens: model.run_with_cache(tokens, return_type=\"loss\", incl_bwd=True)")
                out.backward()
        if not return_cache_object:
            return out, cache_dict
        cache = HookedActivationCache(cache_dict, self, has_batch_dim=not remove_batch_dim)
        cache.names_filter_given = names_filter is not None
        return out, cache

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
