"""`attribute`: the attribution graph of one prompt (circuit-tracer's `attribution/attribute.py`).

The method is circuit-tracer's (Ameisen et al. 2025, "Circuit Tracing"; github.com/safety-research/
circuit-tracer). The weight of an edge is the direct effect of its source on its target's pre-activation
in the linear replacement model (hooked_models/attribution/replacement.py): the target's input direction
(an encoder column; a logit minus the mean logit) backpropagated to where the source writes, dotted with
what it writes (activation x decoder row; the error; the embedding). Each batched backward pass computes
the rows of `batch_size` targets at once, on as many copies of the prompt, so a graph costs one forward
and (targets / batch_size) backward passes, never one pass per edge.
"""

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm import tqdm

from hooked_models.attribution.graph import AttributionGraph, normalized_abs
from hooked_models.attribution.replacement import Prompt, Replica, check_prompt, prompt_tokens, transcoder_names
from hooked_models.attribution.targets import Target, directions, target_rows


def _head_parts(replica: Replica, targets: Sequence[Target], n_heads: int, columns: Tensor, rows: Tensor,
                loadings: Tensor, skips: Tensor) -> None:
    """Write the targets' per-head loadings and skips over the source `columns` into `loadings[rows]`
    and `skips[rows]`: per attention layer, one backward pass per head (that head alone let through)
    and one with none let through (the part that skips the layer). Nothing wider than one pass's rows
    [target source] is held besides the graph's own tensors."""
    grad_inputs, grad_logits = directions(replica, targets)
    device, n, k = replica.logits.device, len(targets), len(columns)
    for layer, holder in replica.gates.items():
        try:
            for head in range(n_heads, -1, -1):  # head n_heads first: none let through, the skip
                holder.gate = torch.zeros(n_heads, 1, device=device)
                if head < n_heads:
                    holder.gate[head] = 1
                part = replica.columns(grad_inputs, grad_logits)[:n, columns].cpu()
                if head == n_heads:
                    skips[rows, :k, layer] = part.to(skips.dtype)
                else:
                    # A pass letting head h through also carries what skips the layer: counted once, apart.
                    loadings[rows, :k, layer, head] = (part - skips[rows, :k, layer].to(part.dtype)).to(loadings.dtype)
        finally:
            holder.gate = None


def _check_arguments(model, tokens: Tensor, transcoders, max_feature_nodes, desired_logit_prob, max_n_logits,
                     batch_size) -> None:
    check_prompt(model, tokens, transcoders)
    if max_feature_nodes is not None and (isinstance(max_feature_nodes, bool) or not isinstance(max_feature_nodes, int)
                                          or max_feature_nodes < 1):
        raise ValueError(f"max_feature_nodes={max_feature_nodes!r} must be a positive integer (None: every active "
                         "feature)")
    if not 0.0 < desired_logit_prob <= 1.0:
        raise ValueError(f"desired_logit_prob={desired_logit_prob} must be in (0, 1]")
    for name, value in (("max_n_logits", max_n_logits), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def attribute(model, prompt, transcoders, *, max_feature_nodes: int | None = None, desired_logit_prob: float = 0.95,
              max_n_logits: int = 10, batch_size: int = 32, progress: bool = False,
              head_loadings: bool = True) -> AttributionGraph:
    """The attribution graph of `prompt` (text or token ids) through `transcoders` (a TranscoderSet or
    CrossLayerTranscoder trained for `model`): see the module docstring.

    `max_feature_nodes`: compute the rows of at most this many features, chosen as circuit-tracer
    chooses them (by their influence on the logits, estimated from the rows computed so far, in
    batches); the others are not nodes. `batch_size`: targets per backward pass (and copies of the
    prompt held for them). `head_loadings`: also split every edge over each attention layer's heads
    (one more backward pass per head and layer, plus one per layer, for the graph's rows only).

    Memory above the model and transcoders: `batch_size` copies of one frozen forward, one backward
    pass's gradients at the leaves, the computed rows (targets x sources: with `max_feature_nodes`,
    only the rows computed) and the graph (nodes², with head loadings nodes² x layers x (heads + 1)).
    No parameter gradients; nothing outlives a backward pass but its rows.
    """
    tokens = prompt_tokens(model, prompt)
    _check_arguments(model, tokens, transcoders, max_feature_nodes, desired_logit_prob, max_n_logits, batch_size)
    state = Prompt(model, tokens, transcoders)
    logit_tokens, logit_probs = state.salient_logits(desired_logit_prob, max_n_logits)
    n_active = state.active.shape[0]
    n_layers, seq = transcoders.n_layers, tokens.shape[1]
    n_sources = n_active + n_layers * seq + seq
    dtype = state.errors.dtype

    replica = Replica(state, batch_size, head_loadings)
    n_heads = model.cfg.n_heads
    vocab = state.logits.shape[-1]

    def logit_target(token: int) -> Target:
        direction = -torch.full((vocab,), 1.0 / vocab, dtype=dtype)  # the logit minus the mean logit
        direction[token] += 1
        return Target(None, seq - 1, direction)

    def feature_target(i: int) -> Target:
        layer, pos, feature = state.active[i].tolist()
        return Target(layer, pos, transcoders.encoder(layer)[:, feature].detach().to(dtype))

    bar = tqdm(desc="attribution", unit="target", disable=not progress)
    computed: dict = {}  # target key -> its row over every source

    def target(key) -> Target:
        return logit_target(int(key[1])) if key[0] == "logit" else feature_target(key[1])

    def compute(keys: list) -> None:
        for start in range(0, len(keys), batch_size):
            chunk = keys[start:start + batch_size]
            rows = target_rows(replica, [target(k) for k in chunk]).cpu()  # the graph is assembled on the CPU
            for j, key in enumerate(chunk):
                computed[key] = rows[j].clone()  # its own storage: the batch's rows go with the batch
            bar.update(len(chunk))

    logit_keys = [("logit", int(t)) for t in logit_tokens]
    if max_feature_nodes is None or max_feature_nodes >= n_active:
        bar.reset(total=len(logit_keys) + n_active)
        compute(logit_keys)
        compute([("feature", i) for i in range(n_active)])
        selected = torch.arange(n_active)
    else:
        bar.reset(total=len(logit_keys) + max_feature_nodes)
        compute(logit_keys)
        selected = _select_features(computed, logit_keys, logit_probs, n_active, max_feature_nodes, batch_size, compute)

    # Assemble over the selected features: columns of the others dropped, each row released as placed.
    keep_columns = torch.cat([selected, torch.arange(n_active, n_sources)])
    n_nodes = len(selected) + n_layers * seq + seq + len(logit_keys)
    adjacency = torch.zeros(n_nodes, n_nodes, dtype=dtype)
    placed = [*zip(range(len(selected)), [("feature", int(i)) for i in selected]),
              *zip(range(n_nodes - len(logit_keys), n_nodes), logit_keys)]
    for r, key in placed:
        adjacency[r, :len(keep_columns)] = computed.pop(key)[keep_columns]
    loadings = skips = None
    if head_loadings:  # the graph's rows only, its columns only, written in place batch by batch
        loadings = torch.zeros(n_nodes, n_nodes, n_layers, n_heads, dtype=dtype)
        skips = torch.zeros(n_nodes, n_nodes, n_layers, dtype=dtype)
        for start in range(0, len(placed), batch_size):
            chunk = placed[start:start + batch_size]
            _head_parts(replica, [target(key) for _, key in chunk], n_heads, keep_columns,
                        torch.tensor([r for r, _ in chunk]), loadings, skips)
    bar.close()
    try:
        str_tokens, logit_str_tokens = model.to_str_tokens(tokens[0]), model.to_str_tokens(logit_tokens)
    except ValueError:  # no tokenizer: the ids stand for themselves
        str_tokens, logit_str_tokens = [str(t) for t in tokens[0].tolist()], []
    return AttributionGraph(
        tokens=tokens[0].cpu(), active_features=state.active[selected].cpu(),
        activation_values=state.activations[selected].detach().cpu(), logit_tokens=logit_tokens.cpu(),
        logit_probabilities=logit_probs.cpu(), adjacency_matrix=adjacency.detach().cpu(), n_layers=n_layers,
        prompt=prompt if isinstance(prompt, str) else "", str_tokens=str_tokens,
        model_name=str(getattr(model.cfg, "model_name", "")), transcoder_names=transcoder_names(transcoders),
        logit_str_tokens=logit_str_tokens,
        head_loadings=None if loadings is None else loadings.detach().cpu(),
        attention_skips=None if skips is None else skips.detach().cpu())


def _select_features(computed: dict, logit_keys: list, logit_probs: Tensor, n_active: int, budget: int,
                     batch_size: int, compute) -> Tensor:
    """circuit-tracer's feature selection: rank the features not yet computed by their influence on the
    logits through the rows computed so far, compute the top batch, repeat until `budget` are. Only the
    computed rows are held ([computed source], never a dense [source source] matrix)."""
    done: list[int] = []
    while len(done) < budget:
        rows = torch.stack([computed[key] for key in [*logit_keys, *[("feature", i) for i in done]]]).float()
        own_column = torch.tensor([-1] * len(logit_keys) + done, dtype=torch.long)
        weights = torch.cat([logit_probs.float().cpu(), torch.zeros(len(done))])
        influence = _influence_of_rows(normalized_abs(rows), own_column, weights)[:n_active]
        influence[done] = -1
        take = influence.argsort(descending=True)[:min(batch_size, budget - len(done))].tolist()
        compute([("feature", i) for i in take])
        done.extend(take)
    return torch.tensor(sorted(done), dtype=torch.long)


def _influence_of_rows(normalized: Float[Tensor, "row source"], own_column: Int[Tensor, " row"],
                       weights: Float[Tensor, " row"]) -> Float[Tensor, " source"]:
    """`_influence` of a graph of which only these rows are nonzero: row r is node `own_column[r]` as a
    source (-1: a logit, no source), `weights` the rows' output weights. The same series, each step
    carried from the sources back to the rows that are those sources."""
    total = current = weights @ normalized
    is_source = own_column >= 0
    for _ in range(normalized.shape[0]):
        at_rows = torch.zeros_like(weights)
        at_rows[is_source] = current[own_column[is_source]]
        if not bool(at_rows.any()):
            break
        current = at_rows @ normalized
        total = total + current
    return total


