"""Sparse autoencoders spliced into a hooked model, as SAELens's `HookedSAETransformer` splices them.

    model.add_sae(sae)                                  # SAELens's SAE: its hook from sae.cfg.metadata.hook_name
    model.add_sae(module, "blocks.1.hook_resid_post")   # any module with encode/decode; a name either way
    logits = model.run_with_saes(tokens, saes=[sae], use_error_term=True)     # == model(tokens), bit for bit
    logits, cache = model.run_with_cache_with_saes(tokens, saes=[sae])
    cache["layers.1.layer_output.hook_sae_acts_post"]   # or "blocks.1.hook_resid_post.hook_sae_acts_post"
    with model.saes(saes={"layers.0.mlp.mlp_output": module}): ...
    model.reset_saes()                                  # the model is bit-identical to before
    model.run_with_saes(tokens, saes=transcoders, use_error_term=True)   # a TranscoderSet: the replacement model

The SAE replaces the value it is spliced on: the value's HookPoint returns the SAE's output, so what the
layers above read, and what a hook on the value sees, is the reconstruction (plus the error term with
`use_error_term`). The SAE's HookPoints hang under the value's name: `hook_sae_input`, `hook_sae_acts_pre`
(SAELens's SAEs; a plain module's encode is opaque), `hook_sae_acts_post`, `hook_sae_recons`,
`hook_sae_error`, `hook_sae_output`, each also under the value's TransformerLens name.

Layout. An SAE reads `[batch pos d_in]`: the value in TransformerLens's layout, every axis after the
position flattened, so a head value's width is heads x head_dim in TransformerLens's order
(`hook_z`, `hook_v`: [batch pos (head d_head)]). That is what SAELens's activation store trains on, and
the same for either name: an SAE trained at `blocks.0.attn.hook_v` splices at
`layers.0.self_attn.attention_values` too (whose standard layout, [batch kv_head seq d], is converted).
SAELens's hook_z SAEs that flatten their own input (`reshape_activations="hook_z"`) are given
[batch pos head d_head]. The output is cast back to the value's dtype.

Error term. With `use_error_term=True` the output is recons + error, error = value − the SAE's
reconstruction with its hooks off (SAELens's definition), written as value − (clean − recons) −
(error − error as hooked): mathematically the same, and exactly the value, bit for bit, when no hook
changed a feature, the reconstruction or the error. An edit to the features moves the output by the
edit's effect on the reconstruction.

Transcoders. A module that names two values, the one it reads (`hook_name`, SAELens's
`cfg.metadata.hook_name`) and the one it writes (`hook_name_out`), is a transcoder: it is spliced on
the value it writes, its input read from the other value as the model reads it on (after every hook:
`ValueHook.readers`), and its reconstruction is decode(encode(input)) (+ input @ W_skip.T where it has
a skip connection). The error is the written value minus that, so with `use_error_term` the value is
again bit for bit what it was; the written value enters as a constant (SAELens's error term), so
gradients reach the layers below through the transcoder alone, not through the MLP it replaces. A set
of them (a `TranscoderSet`: anything with `spliced_modules()`) splices each.
"""

import math
from collections.abc import Iterable, Mapping
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from hooked_models.hooks import ValueHook
from hooked_models.sae_metadata import sae_hook_name, sae_hook_name_out, sae_out_width, sae_width
from hooked_models.vocabulary import Value

# The SAE's HookPoints, in the order they fire; SAELens's SAEs call the first four inside encode/decode.
SAE_HOOKS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error",
             "hook_sae_output")
_SAE_OWN = SAE_HOOKS[:4]
# A plain module's encode is opaque: the splice can show its input, its features and its reconstruction.
_SPLICE_MADE = ("hook_sae_input", "hook_sae_acts_post", "hook_sae_recons")





def _spliced_modules(saes) -> list[nn.Module]:
    """A module, or a list of them, with each set (`spliced_modules()`) expanded into its members."""
    modules = [saes] if isinstance(saes, nn.Module) else list(saes)
    return [m for module in modules for m in (module.spliced_modules() if hasattr(module, "spliced_modules")
                                              else [module])]



class _Splice:
    """One SAE on one value: what the value's HookPoint runs in place of the identity. A transcoder's
    splice reads its input at `input_point` (another value) instead of the value it replaces."""

    def __init__(self, sae: nn.Module, point: ValueHook, use_error_term: bool, input_point: ValueHook | None = None):
        self.sae, self.point, self.value, self.use_error_term = sae, point, point.value, use_error_term
        self.input_point, self._input = input_point, None
        # SAELens's hook_z SAEs flatten (and unflatten) the heads themselves.
        self.sae_flattens = bool(getattr(sae, "hook_z_reshaping_mode", False))
        self.own = {n: getattr(sae, n) for n in _SAE_OWN if isinstance(getattr(sae, n, None), HookPoint)}
        # The error and the output are the splice's (as HookedSAETransformer's wrapper makes its own).
        made = [n for n in _SPLICE_MADE if n not in self.own] + ["hook_sae_error", "hook_sae_output"]
        self.made = {n: HookPoint() for n in made}
        self.hooks = {n: self.own.get(n) or self.made[n] for n in SAE_HOOKS if n in self.own or n in self.made}
        self._own_names = {n: p.name for n, p in self.own.items()}

    def __call__(self, x: Tensor) -> Tensor:
        width = sae_width(self.sae) if self.input_point is None else sae_out_width(self.sae)
        target = self._to_sae(x, self.point, width)
        if self.input_point is None:
            sae_in = target
        else:
            if self._input is None:
                raise RuntimeError(f"the transcoder on {self.point.name!r} found no input at {self.input_point.name!r}")
            sae_in, self._input = self._to_sae(self._input, self.input_point, sae_width(self.sae)), None
            target = target.detach()  # the error term is a constant: no gradient through what it replaces
        recons = self._decode(self._encode(sae_in, self.made), sae_in, self.made)
        if not self.use_error_term:
            out = recons
        else:
            with torch.no_grad():
                clean = self._clean_recons(sae_in) if self._hooked() else recons.detach()
                error = target - clean
                hooked_error = self._fire("hook_sae_error", error)
            out = target - (clean - recons) - (error - hooked_error)
        return self._from_sae(self._fire("hook_sae_output", out), x)

    def _read_input(self, x: Tensor) -> None:
        self._input = x

    # ------------------------------------------------------------------------------------ steps
    def _fire(self, name: str, tensor: Tensor, hooks: Mapping[str, HookPoint] | None = None) -> Tensor:
        point = (self.made if hooks is None else hooks).get(name)
        return tensor if point is None else point(tensor)

    def _encode(self, sae_in: Tensor, hooks: Mapping[str, HookPoint]) -> Tensor:
        return self._fire("hook_sae_acts_post", self.sae.encode(self._fire("hook_sae_input", sae_in, hooks)), hooks)

    def _decode(self, acts: Tensor, sae_in: Tensor, hooks: Mapping[str, HookPoint]) -> Tensor:
        recons = self.sae.decode(acts)
        w_skip = getattr(self.sae, "W_skip", None)  # a skip transcoder's, [d_out d_in]
        if self.input_point is not None and w_skip is not None:
            recons = recons + sae_in.to(w_skip.dtype) @ w_skip.T
        return self._fire("hook_sae_recons", recons, hooks)

    def _hooked(self) -> bool:
        return any(p.fwd_hooks or p.bwd_hooks for p in self.hooks.values())

    def _clean_recons(self, sae_in: Tensor) -> Tensor:
        """The reconstruction with every SAE hook off (the SAE's own swapped out, as SAELens does)."""
        identity = nn.Identity()
        try:
            for name in self.own:
                setattr(self.sae, name, identity)
            return self._decode(self.sae.encode(sae_in), sae_in, {})
        finally:
            for name, point in self.own.items():
                setattr(self.sae, name, point)

    def _to_sae(self, x: Tensor, point: ValueHook, expected: int | None) -> Tensor:
        tl = point.value.to_tl(x)
        flat = tl if self.sae_flattens else tl.flatten(2)
        width = tl.shape[2:].numel()
        if expected is not None and width != expected:
            raise ValueError(width_error(point.name, point.value, width, expected))
        return flat

    def _from_sae(self, out: Tensor, like: Tensor) -> Tensor:
        tl_shape = self.value.to_tl(like).shape
        if tuple(out.shape[:2]) != tuple(tl_shape[:2]) or out.shape[2:].numel() != tl_shape[2:].numel():
            raise ValueError(f"the SAE on {self.point.name!r} returned shape {tuple(out.shape)}; the value it "
                             f"replaces is {tuple(tl_shape)} in TransformerLens's layout")
        return self.value.from_tl(out.reshape(tl_shape)).to(like.dtype)

    # ---------------------------------------------------------------------------- attach/detach
    def attach(self) -> None:
        for name, point in self.hooks.items():
            setattr(self.point, name, point)
        self.point.splice = self
        if self.input_point is not None:
            self.input_point.readers = (*self.input_point.readers, self._read_input)

    def detach(self) -> None:
        for name in self.hooks:
            delattr(self.point, name)
        if self.input_point is not None:
            self.input_point.readers = tuple(r for r in self.input_point.readers if r != self._read_input)
            self._input = None
        for name, point in self.own.items():
            point.name = self._own_names[name]  # the model's setup renamed them
        self.point.splice = None


def width_error(name: str, value: Value, width: int, expected: int) -> str:
    return (f"an SAE of width {expected} cannot read {name!r}, {value.layout_text}: it is {width} wide as an SAE "
            f"reads it ([batch pos d_in], the heads flattened in TransformerLens's order)")


class SAEMixin:
    """`add_sae`, `reset_saes`, `run_with_saes`, `run_with_cache_with_saes`, `run_with_hooks_with_saes`
    and the `saes()` context, mixed into HookedModel; SAELens is never imported."""

    @property
    def acts_to_saes(self) -> dict[str, nn.Module]:
        """The spliced SAEs by the standard name of the value each replaces."""
        return {name: point.splice.sae for name, point in self.standard_hook_dict.items()
                if isinstance(point, ValueHook) and point.splice is not None}

    def add_sae(self, sae: nn.Module, hook_name: str | None = None, use_error_term: bool | None = None) -> None:
        """Splice `sae` into the value `hook_name` names (standard or TransformerLens name; by default
        the SAE's own: SAELens's `cfg.metadata.hook_name`), replacing any SAE there, until `reset_saes`.

        `use_error_term` (default: the SAE's own `use_error_term`, else False) adds the SAE's error,
        so the model computes what it did unspliced while the features stay readable and patchable.
        A transcoder (it names the value it writes, `hook_name_out`) is spliced on that value and reads
        its own `hook_name`; `hook_name`, if given, must name the value it writes. A set of them
        (`spliced_modules()`, a TranscoderSet) adds each.
        """
        if hasattr(sae, "spliced_modules"):
            for module in sae.spliced_modules():
                self.add_sae(module, None, use_error_term)
            return
        point, input_point = self._splice_point(sae, hook_name)
        if use_error_term is None:
            use_error_term = bool(getattr(sae, "use_error_term", False))
        if point.splice is not None:
            point.splice.detach()
        _Splice(sae, point, use_error_term, input_point).attach()
        self.setup()

    def _splice_point(self, sae: nn.Module, hook_name: str | None) -> tuple[ValueHook, ValueHook | None]:
        """The HookPoint of the value `sae` would replace, and a transcoder's input's (else None), every
        precondition checked (nothing changed)."""
        name = hook_name or sae_hook_name(sae)
        if name is None:
            raise ValueError(f"{type(sae).__name__} names no hook (no cfg.metadata.hook_name or hook_name): "
                             "pass hook_name=")
        if not (callable(getattr(sae, "encode", None)) and callable(getattr(sae, "decode", None))):
            raise ValueError(f"{type(sae).__name__} has no encode/decode: an SAE maps [batch pos d_in] to "
                             "features and back")
        in_name, out_name = sae_hook_name(sae), sae_hook_name_out(sae)
        if out_name in (None, in_name):  # an SAE: it writes back where it reads
            canonical, _ = self.resolve_hook_name(name)
            point = self.standard_hook_dict[canonical]
            self._check_spliceable(canonical, point, sae_width(sae))
            return point, None
        canonical, _ = self.resolve_hook_name(out_name)
        if hook_name is not None and self.resolve_hook_name(hook_name)[0] != canonical:
            raise ValueError(f"{type(sae).__name__} reads {in_name!r} and writes {out_name!r} (a transcoder): it is "
                             f"spliced on the value it writes, not on {hook_name!r}")
        point = self.standard_hook_dict[canonical]
        self._check_spliceable(canonical, point, sae_out_width(sae))
        in_canonical, _ = self.resolve_hook_name(in_name)
        input_point = self.standard_hook_dict[in_canonical]
        self._check_spliceable(in_canonical, input_point, sae_width(sae))
        return point, input_point

    def _check_spliceable(self, name: str, point: HookPoint, expected: int | None) -> None:
        if not isinstance(point, ValueHook):
            raise ValueError(f"{name!r} is not a value of the model; an SAE splices into one of model.support()")
        value = point.value
        dims = value.dims if value.tl_layout is None else _tl_dims(value)
        if value.read_only or len(dims) < 3 or dims[:2] != ("batch", "seq"):
            raise ValueError(f"an SAE cannot replace {name!r}, {value.layout_text}"
                             f"{' (read-only)' if value.read_only else ''}: it reads and writes a value laid out "
                             "[batch seq ...] (in TransformerLens's layout)")
        sizes = {d: getattr(self.cfg, d, None) for d in dims[2:]}
        if expected is not None and all(isinstance(s, int) for s in sizes.values()):
            width = math.prod(sizes.values())
            if width != expected:
                raise ValueError(width_error(name, value, width, expected))

    def reset_saes(self, hook_names: str | Iterable[str] | None = None) -> None:
        """Remove the SAEs on the named values (either name), or every SAE: the model is then
        bit-identical to what it was before they were added."""
        if isinstance(hook_names, str):
            hook_names = [hook_names]
        spliced = self.acts_to_saes
        names = list(spliced) if hook_names is None else [self.resolve_hook_name(n)[0] for n in hook_names]
        for name in names:
            if name not in spliced:
                raise ValueError(f"no SAE is spliced on {name!r}; SAEs are on {sorted(spliced)}")
        for name in names:
            self.standard_hook_dict[name].splice.detach()
        self.setup()

    @contextmanager
    def saes(self, saes=(), reset_saes_end: bool = True, use_error_term: bool | None = None):
        """SAEs spliced for the block: an SAE, a list of them (a TranscoderSet: each of its transcoders),
        or {hook name: SAE} for modules that name no hook. On exit (with `reset_saes_end`) the values are
        as they were, SAEs that were there before included."""
        if isinstance(saes, Mapping):
            pairs = list(saes.items())
        else:
            pairs = [(None, sae) for sae in _spliced_modules(saes)]
        previous: list[tuple[ValueHook, _Splice | None]] = []
        try:
            for name, sae in pairs:
                point, _ = self._splice_point(sae, name)
                previous.append((point, point.splice))
                self.add_sae(sae, name, use_error_term)
            yield self
        finally:
            if reset_saes_end:
                for point, splice in reversed(previous):
                    if point.splice is not None:
                        point.splice.detach()
                    if splice is not None:
                        splice.attach()
                self.setup()

    def run_with_saes(self, *model_args, saes=(), reset_saes_end: bool = True, use_error_term: bool | None = None,
                      **model_kwargs):
        """The forward with `saes` spliced for this call (see `saes()`)."""
        with self.saes(saes, reset_saes_end, use_error_term):
            return self(*model_args, **model_kwargs)

    def run_with_cache_with_saes(self, *model_args, saes=(), reset_saes_end: bool = True,
                                 use_error_term: bool | None = None, **kwargs):
        """`run_with_cache` with `saes` spliced: the cache holds their HookPoints under the values' names."""
        with self.saes(saes, reset_saes_end, use_error_term):
            return self.run_with_cache(*model_args, **kwargs)

    def run_with_hooks_with_saes(self, *model_args, saes=(), reset_saes_end: bool = True,
                                 use_error_term: bool | None = None, **kwargs):
        """`run_with_hooks` with `saes` spliced: hooks may name the SAEs' HookPoints."""
        with self.saes(saes, reset_saes_end, use_error_term):
            return self.run_with_hooks(*model_args, **kwargs)


def _tl_dims(value: Value) -> tuple[str, ...]:
    """A value's dimensions in TransformerLens's layout."""
    source, target = (side.split() for side in value.tl_layout.split("->"))
    return tuple(value.dims[source.index(name)] for name in target)


def cache_activations_runner(model, cfg, override_dataset=None):
    """SAELens's `CacheActivationsRunner` around a hooked model (SAELens must be installed).

    The runner loads its model by name (`cfg.model_class_name`, `cfg.model_name`) and, unlike the
    training runner, takes no `override_model`; this builds SAELens's own runner with `model` as that
    model (its loader answers with it while the constructor runs) and leaves the rest to SAELens:
    `cache_activations_runner(model, cfg, dataset).run()` writes the activations at `cfg.hook_name`.
    """
    import sae_lens.cache_activations_runner as runner_module

    loader = runner_module.load_model
    runner_module.load_model = lambda *args, **kwargs: model
    try:
        return runner_module.CacheActivationsRunner(cfg, override_dataset=override_dataset)
    finally:
        runner_module.load_model = loader
