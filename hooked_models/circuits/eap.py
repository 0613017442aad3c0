"""Edge attribution: every edge's score at once, EAP (one backward on the clean run) or EAP-IG (averaged
over interpolated embeddings, batched)."""

import warnings

import torch
from torch import Tensor

from hooked_models.circuits.graph import Graph
from hooked_models.circuits.layout import _check_runs, _Layout, _slots, _stream_bytes, _writer_outputs
from hooked_models.patching.inputs import Metric, _scalar
from hooked_models.patching.runner import row_bytes
from hooked_models.progress import ProgressArg, tracker

METHODS = ("eap", "eap-ig")
# EAP-IG's Riemann sum has converged long before this many steps (its papers use 5 to 100); a call with more
# is warned, since each step is a forward and a backward of every pair (the explorer refuses more).
MANY_STEPS = 1000


# ------------------------------------------------------------------------------------- attribution
def edge_attribution(
    model,
    clean,
    corrupted,
    metric: Metric,
    method: str = "eap-ig",
    steps: int = 5,
    *,
    batch_size: int | None = None,
    memory_budget: int = 2**30,
    progress: ProgressArg = None,
) -> Graph:
    """A score for every edge of the model's graph: the estimated `edge_patch(..., [[edge]])` minus the clean
    metric, (corrupted - clean output of the writer) · the gradient of the metric at the reader's input.

    method "eap": the gradient on the clean run (one clean forward, one corrupted forward, one backward).
    method "eap-ig": the gradient averaged over `steps` inputs whose token embeddings lie at the midpoints
    (k + 1/2) / steps of the way from the clean embeddings to the corrupted ones (integrated gradients on the
    embeddings); the steps run batched, `batch_size` of them per forward and backward (default: as many as
    `memory_budget` bytes allow). Many prompt pairs are scored at once: the metric averages over them.

    Cost: EAP is two forwards and one backward of the pairs. EAP-IG is those two forwards plus, for each step,
    one forward and one backward of every pair (the steps batched, so ceil(steps / batch_size) passes, each
    `batch_size` times as wide): its time grows linearly in `steps`, about `steps` times EAP's backward.
    More than `MANY_STEPS` (1,000) steps is warned, with the passes it will take.
    progress: False, True (a tqdm bar), None (a bar on a terminal when the steps take several forwards), or a
    callable handed a `hooked_models.progress.Step` in steps (EAP: one) after each backward; raising
    `Cancelled` stops it there, the model left as it was.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive integer")
    layout = _Layout(model)
    clean, corrupted = _check_runs(model, clean, corrupted)
    batch, seq = clean.shape
    readers = [h.name for h in layout.reader_hooks]
    if method == "eap":
        total, per_forward = 1, 1
    else:
        # A step holds a forward's activations and their gradients, with the split inputs (and theirs).
        per_step = 4 * row_bytes(model, clean) + _stream_bytes(model, clean) * 12 * model.cfg.n_heads
        total, per_forward = steps, batch_size or max(1, memory_budget // per_step)
        if steps > MANY_STEPS:
            passes = -(-steps // per_forward)
            warnings.warn(f"steps={steps} is over {MANY_STEPS}: {passes} forward and backward passes of "
                          f"{min(steps, per_forward)} x {batch} pairs x {seq} tokens, each step as costly as "
                          f"EAP's backward; EAP-IG has converged long before (5 to 100 steps are usual). "
                          f"progress=True shows a bar", stacklevel=2)
    with tracker(progress, total=total, desc=f"edge attribution ({method})", unit="step",
                 long=method == "eap-ig" and steps > per_forward) as done:
        # 0 steps of `total`, said before the runs that precede the first step (a job reads no None meanwhile)
        done.reset(total)
        corrupted_logits, corrupted_out = _writer_outputs(model, corrupted, layout, ["token_embeddings"])
        corrupted_metric = float(_scalar(metric(corrupted_logits)))
        if method == "eap":
            grads, clean_out, clean_metric = _reader_gradients(model, clean, metric, readers, layout)
            done.advance()
        else:
            clean_logits, clean_out = _writer_outputs(model, clean, layout, ["token_embeddings"])
            clean_metric = float(_scalar(metric(clean_logits)))
            embeddings = (clean_out["token_embeddings"], corrupted_out["token_embeddings"])
            alphas = (torch.arange(steps, dtype=torch.float32) + 0.5) / steps
            grads = {}
            for start in range(0, steps, per_forward):
                part, _, _ = _reader_gradients(model, clean, metric, readers, layout, embeddings,
                                               alphas[start:start + per_forward])
                for name, g in part.items():
                    grads[name] = g if name not in grads else grads[name] + g
                done.advance(len(alphas[start:start + per_forward]))
            grads = {name: g / steps for name, g in grads.items()}
    scores = _scores(layout, corrupted_out, clean_out, grads, seq, clean.device)
    return Graph(list(layout.edges), scores, method if method == "eap" else f"eap-ig ({steps} steps)",
                 clean_metric, corrupted_metric, dict(layout.sizes))


def _reader_gradients(model, tokens: Tensor, metric: Metric, readers: list[str], layout: _Layout,
                      embeddings: tuple[Tensor, Tensor] | None = None, alphas: Tensor | None = None):
    """d metric / d (each reader hook's value) [batch seq (slots) hidden_size], summed over the interpolation
    steps `alphas` when given (their embeddings replace the token embeddings); with the writers' outputs and
    the metric of the run (the clean run when no alphas)."""
    seen: dict[str, Tensor] = {}
    copies = 1 if alphas is None else len(alphas)
    batch = tokens.shape[0]

    def keep(value, hook):
        seen[hook.name] = value

    def embed(value, hook):
        if embeddings is None:
            # With frozen parameters nothing would require grad: start the graph at the embeddings.
            return None if value.requires_grad else value.detach().requires_grad_(True)
        clean, corrupted = embeddings
        alpha = alphas.to(device=value.device, dtype=value.dtype)[:, None, None, None]
        mixed = (clean + alpha * (corrupted - clean)).flatten(0, 1)
        return mixed.detach().requires_grad_(True)

    writers = [h.name for h in layout.writer_hooks]
    hooks = [("token_embeddings", embed)] + [(n, keep) for n in readers + writers]
    with torch.enable_grad(), model.hooks(fwd_hooks=hooks):
        logits = model(tokens.repeat(copies, 1))
        total = sum(metric(chunk) for chunk in logits.unflatten(0, (copies, batch)))
        grads = torch.autograd.grad(total, [seen[n] for n in readers], allow_unused=True)
    out = {}
    for name, grad in zip(readers, grads):
        grad = torch.zeros_like(seen[name]) if grad is None else grad
        out[name] = grad.detach().unflatten(0, (copies, batch)).sum(0)
    writer_values = {n: seen[n].detach() for n in writers}
    return out, writer_values, float(_scalar(total / copies))


def _scores(layout: _Layout, corrupted_out: dict, clean_out: dict, grads: dict, seq: int, device) -> Tensor:
    """Σ over prompts and positions of (corrupted - clean writer output) · reader gradient, per edge."""
    deltas = [(_slots(corrupted_out[h.name], h) - _slots(clean_out[h.name], h)).float() for h in layout.writer_hooks]
    writer_nodes = [h.nodes_at(seq, device) for h in layout.writer_hooks]
    matrix = torch.zeros(len(layout.writers) * len(layout.readers), dtype=torch.float64, device=device)
    for hook in layout.reader_hooks:
        available = [i for i, w in enumerate(layout.writer_hooks) if w.step < hook.step]
        delta = torch.cat([deltas[i] for i in available], dim=-2)  # [batch seq writer_slots hidden_size]
        grad = _slots(grads[hook.name], hook).float()                # [batch seq reader_slots hidden_size]
        per_position = torch.einsum("bswd,bsrd->swr", delta, grad)
        w_nodes = torch.cat([writer_nodes[i] for i in available]).T     # [seq writer_slots]
        r_nodes = hook.nodes_at(seq, device).T                          # [seq reader_slots]
        index = w_nodes[:, :, None] * len(layout.readers) + r_nodes[:, None, :]
        matrix.index_add_(0, index.flatten(), per_position.flatten().double())
    matrix = matrix.view(len(layout.writers), len(layout.readers))
    w = torch.tensor([layout.writer_index[e[0]] for e in layout.edges], device=device)
    r = torch.tensor([layout.reader_index[e[1]] for e in layout.edges], device=device)
    return matrix[w, r].float().cpu()
