"""Attribution patching (Nanda 2023): every patch of a sweep estimated from one forward and one backward."""

from collections.abc import Sequence

import torch
from torch import Tensor

from hooked_models.patching.inputs import Metric, _runs, _scalar
from hooked_models.patching.result import PatchingResult, _result
from hooked_models.patching.sites import _plan_from_cache, find_sites


def attribution_patch(
    model,
    clean,
    corrupted,
    metric: Metric,
    value: str = "layer_input",
    over: Sequence[str] | None = None,
    *,
    direction: str = "denoising",
    select: dict[str, Sequence[int]] | None = None,
    position_labels: Sequence[str] | None = None,
) -> PatchingResult:
    """The first-order estimate of `activation_patch`'s result, from one forward and one backward.

    For each patch: metric(base) + Σ over the patched elements (and prompts) of
    ∂metric/∂activation · (source − base), with the gradient taken on the unpatched run the patches
    would be written into. Exact where the metric is linear in the patched value; an estimate
    elsewhere that degrades as the patch grows (Nanda 2023; Syed et al. 2023, "AtP").
    """
    base, source = _runs(model, clean, corrupted, direction)
    sites = find_sites(model, value)
    names = [s.name for s in sites]
    with torch.no_grad():
        source_logits, cache = model.run_with_cache(source, names_filter=names)
    seen: dict[str, Tensor] = {}

    def keep(activation: Tensor, hook) -> None:
        seen[hook.name] = activation

    def leaf(activation: Tensor, hook) -> Tensor | None:
        # With frozen parameters nothing would require grad: start the graph at the embeddings.
        return None if activation.requires_grad else activation.detach().requires_grad_(True)

    hooks = [(n, keep) for n in names]
    if "token_embeddings" in model.hook_dict:
        hooks.insert(0, ("token_embeddings", leaf))
    with torch.enable_grad(), model.hooks(fwd_hooks=hooks):
        base_logits = model(base)
        base_metric = metric(base_logits)
        grads = torch.autograd.grad(base_metric, [seen[n] for n in names], allow_unused=True)
    # Per site, grad · (source − base) summed over prompts: what each element would add.
    contributions = {}
    for name, grad in zip(names, grads):
        delta = (cache[name] - seen[name].detach()).float()
        contributions[name] = torch.zeros_like(delta[0]) if grad is None else (grad.float() * delta).sum(0)
    grid, patches = _plan_from_cache(model, sites, cache, over, select, position_labels)
    estimates = torch.stack([_attribution(contributions[p.site], p.index) for p in patches])
    base_metric = float(_scalar(base_metric))
    return _result(base_metric + estimates.cpu(), grid, value, direction, base_metric,
                   float(_scalar(metric(source_logits))), method="attribution patching")


def _attribution(contribution: Tensor, index: tuple) -> Tensor:
    """The sum of a site's contributions over the elements one patch overwrites."""
    for d, selector in reversed(list(enumerate(index))):
        if selector is None:
            contribution = contribution.sum(d)
        else:
            picked = list(selector) if isinstance(selector, tuple) else [selector]
            contribution = contribution.index_select(d, torch.tensor(picked, device=contribution.device)).sum(d)
    return contribution
