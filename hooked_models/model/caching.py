"""The activation cache: hooks that store each selected value under its standard name, and `run_with_cache`."""

from functools import partial

from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities import Slice

from hooked_models.cache import HookedActivationCache
from hooked_models.hooks import ValueHook

# Position axis marker for a spliced SAE's HookPoints: the axis after the batch, whatever their rank.
_SECOND_AXIS = "second"


class Caching:
    """`HookedModel`'s cache: `get_caching_hooks` (names or filters in either naming, `pos_slice` along each
    value's own position axis) and `run_with_cache`, which returns a `HookedActivationCache`."""

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
