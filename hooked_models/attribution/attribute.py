"""`attribute`: the attribution graph of one prompt (circuit-tracer's `attribution/attribute.py`).

The method is circuit-tracer's (Ameisen et al. 2025, "Circuit Tracing"; github.com/safety-research/
circuit-tracer). The weight of an edge is the direct effect of its source on its target's pre-activation
in the linear replacement model (hooked_models/attribution/replacement.py): the target's input direction
(an encoder column; a logit minus the mean logit) backpropagated to where the source writes, dotted with
what it writes (activation x decoder row; the error; the embedding). Each batched backward pass computes
the rows of `batch_size` targets at once, so a graph costs one forward and (targets / batch_size) backward
passes, never one pass per edge: on an Arcee with per-layer transcoders a backward written out
(linear_backward.py: each target from its own layer over its own positions), elsewhere autograd's batched
gradients over one frozen forward (replacement.py's replicas).
"""

import functools
import gc
from collections.abc import Iterable, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from hooked_models.attribution.attention import split_attention
from hooked_models.attribution.graph import AttributionGraph
from hooked_models.attribution.linear_backward import LinearBackward, refusal
from hooked_models.attribution.replacement import (
    Prompt,
    Replica,
    Replicas,
    check_prompt,
    prompt_tokens,
    transcoder_names,
)
from hooked_models.attribution.targets import OutputTarget, Target, directions, resolve, target_rows
from hooked_models.progress import ProgressArg, tracker


def check_arguments(model, tokens: Tensor, transcoders, max_feature_nodes, desired_logit_prob, max_n_logits,
                    batch_size, head_loadings, qk, keep_position_zero) -> None:
    """A ValueError naming the first of `attribute`'s arguments that is out of bounds (attribute_dataset checks
    its settings with it before the first graph)."""
    check_prompt(model, tokens, transcoders)
    if not isinstance(keep_position_zero, bool):
        raise ValueError(f"keep_position_zero={keep_position_zero!r} must be True or False")
    if max_feature_nodes is not None and (isinstance(max_feature_nodes, bool) or not isinstance(max_feature_nodes, int)
                                          or max_feature_nodes < 1):
        raise ValueError(f"max_feature_nodes={max_feature_nodes!r} must be a positive integer (None: every active "
                         "feature)")
    if not 0.0 < desired_logit_prob <= 1.0:
        raise ValueError(f"desired_logit_prob={desired_logit_prob} must be in (0, 1]")
    for name, value in (("max_n_logits", max_n_logits), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if head_loadings not in (True, False, "pruned", "all"):
        raise ValueError(f"head_loadings={head_loadings!r} must be 'pruned', 'all' or False")
    # A count of entries (never a bool, which int accepts; never negative, which slicing would read as
    # "all but the weakest") or the entries themselves.
    counted = isinstance(qk, int) and not isinstance(qk, bool)
    if (counted and qk < 0) or (not counted and (isinstance(qk, (str, bytes, bool)) or not isinstance(qk, Iterable))):
        raise ValueError(f"qk={qk!r} must be a number of entries (an integer >= 0) or a list of "
                         "(layer, head, query_pos, key_pos)")


def _collector_paused(fn):
    """`fn` with Python's cyclic garbage collector paused while it runs (restored after): the objects it
    allocates (rows, hooks, autograd's) are freed by reference counting, and a full collection over a
    process holding a model and its imports took 0.2 s, longer than a small graph."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return paused


@_collector_paused
def attribute(model, prompt, transcoders, *, targets=None, max_feature_nodes: int | None = None,
              desired_logit_prob: float = 0.95, max_n_logits: int = 10, batch_size: int = 32,
              head_loadings: bool | str = "pruned", qk: int | Sequence[tuple[int, int, int, int]] = 16,
              node_threshold: float = 0.8, edge_threshold: float = 0.98, keep_position_zero: bool = False,
              progress: ProgressArg = False) -> AttributionGraph:
    """The attribution graph of `prompt` (text or token ids) through `transcoders` (a TranscoderSet or
    CrossLayerTranscoder trained for `model`): see the module docstring.

    `targets`: the output nodes (hooked_models/attribution/targets.py: token ids or strings, each token
    once, (a, b) logit differences, `CustomTarget`s); None: the most probable next tokens up to
    `desired_logit_prob`, at most `max_n_logits` (circuit-tracer's salient logits). `max_feature_nodes`:
    compute the rows of at most this many features, chosen as circuit-tracer chooses them (by their
    influence on the outputs, estimated from the rows computed so far, in batches); the others are not
    nodes. `batch_size`: targets per backward pass (the gradients of that many held at once).

    `keep_position_zero`: by default the features at position 0 are not nodes and the errors there are
    zero (circuit-tracer's treatment of the BOS token it prepends): the first position's activations are
    an artefact of its role as the attention sink, large on every prompt, and would take a share of
    `max_feature_nodes` and of pruning while saying nothing about the prompt; both tools drop them, so the
    same budget gives circuit-tracer's nodes. What the MLPs write there is held at its value, a constant
    like the biases (every node's incoming edges plus its bias still sum to its value). True: they are
    nodes like any other (a prompt that does not start with BOS, say).

    `head_loadings`: split edges over each attention layer's heads (hooked_models/attribution/heads.py):
    "pruned" (the edges `prune(node_threshold, edge_threshold)` keeps), "all" or True (every edge: for
    small graphs) or False.
    `qk`: with head loadings, the QK attributions of this many pattern entries (an integer >= 0: those the
    kept targets read through most, hooked_models/attribution/qk.py), or of the (layer, head, query_pos,
    key_pos) entries listed; 0: none. Both read one forward decomposition of the kept sources.

    `progress`: hooked_models/progress.py's `progress=` (phases "logits", "features", "gradients",
    "decomposition"); a callable raising `Cancelled` stops the run at a batch, the model's hooks removed.

    Memory above the model and transcoders: the prompt's frozen patterns and norm scales; on autograd's
    path one frozen forward (and its prefixes', together at most 1.5 times as much); one batched backward
    pass's gradients at the leaves (batch x positions x hidden per layer), the computed rows (targets x sources: with `max_feature_nodes`,
    only the rows computed) and the graph (nodes²); with head loadings, the kept targets' gradients at
    the head outputs (kept targets x layers x seq x heads x head_dim) and [kept edge layer head].
    No parameter gradients; nothing outlives a backward pass but its rows.
    """
    tokens = prompt_tokens(model, prompt)
    check_arguments(model, tokens, transcoders, max_feature_nodes, desired_logit_prob, max_n_logits, batch_size,
                    head_loadings, qk, keep_position_zero)
    state = Prompt(model, tokens, transcoders, keep_position_zero=keep_position_zero)
    if targets is None:
        outputs = salient_targets(model, state, desired_logit_prob, max_n_logits)
    else:
        outputs = resolve(model, targets, state.logits[0])
    n_active = state.active.shape[0]
    n_layers, seq = transcoders.n_layers, tokens.shape[1]
    n_sources = n_active + n_layers * seq + seq
    dtype = state.errors.dtype
    # The written-out backward where it serves (an Arcee with per-layer transcoders), else autograd's over
    # replicas of the prompt and its prefixes (at most 3, none shorter than 8).
    written_out = refusal(model, transcoders) is None
    backward = LinearBackward(state) if written_out else None
    replicas = None if written_out else Replicas(state, step=max(8, -(-seq // 4)))
    encoders = _active_encoders(transcoders, state.active, dtype)
    active = state.active.tolist()

    def target(key) -> Target:
        if key[0] == "output":
            output = outputs[key[1]]
            return Target(None, output.pos, output.direction.to(dtype))
        layer, pos, feature = active[key[1]]
        return Target(layer, pos, encoders[layer, feature])

    output_keys = [("output", k) for k in range(len(outputs))]
    budget = n_active if max_feature_nodes is None else min(max_feature_nodes, n_active)
    n_nodes = budget + n_layers * seq + seq + len(output_keys)
    if budget == n_active:  # every feature: each row written straight into the graph's adjacency
        computed = _Rows(torch.zeros(n_nodes, n_nodes, dtype=dtype),
                         {**{("feature", i): i for i in range(n_active)},
                          **{key: n_nodes - len(output_keys) + k for k, key in enumerate(output_keys)}})
    else:  # rows in the order computed, each over every active feature's column until the selection is done
        computed = _Rows(torch.zeros(len(output_keys) + budget, n_sources, dtype=dtype))

    def position(key) -> tuple[int, int]:
        return (n_layers, outputs[key[1]].pos) if key[0] == "output" else tuple(active[key[1]][:2])

    with tracker(progress, total=len(output_keys), desc="attribution", unit="target", phase="logits") as track:

        def compute(keys: list) -> None:
            # By layer and position, so that each chunk's backward pass stops at its layer and runs over the
            # shortest prefix holding its targets' positions (replacement.Replicas); the chunks by prefix
            # length, so that each prefix is run forward once per call.
            keys = sorted(keys, key=position)
            chunks = [keys[start:start + batch_size] for start in range(0, len(keys), batch_size)]
            last = [max(position(k)[1] for k in chunk) for chunk in chunks]
            lengths = last if written_out else [replicas.length(p) for p in last]
            for i in sorted(range(len(chunks)), key=lengths.__getitem__):
                index, block = computed.place(chunks[i], state.errors.device)
                chunk = [target(k) for k in chunks[i]]
                if written_out:
                    rows = backward.rows(chunk, out=block)
                else:
                    rows = target_rows(replicas(lengths[i]), chunk, out=block)
                computed.add(index, rows.cpu(), written=block is not None)  # assembled on the CPU
                track.advance(len(chunks[i]))

        compute(output_keys)
        track.reset(budget, "features")
        weights = torch.tensor([o.weight for o in outputs])
        if budget == n_active:
            compute([("feature", i) for i in range(n_active)])
            selected, adjacency = torch.arange(n_active), computed.out
        else:
            selected = _select_features(computed, weights, n_active, budget, batch_size, compute)
            adjacency = computed.assembled(selected, output_keys, n_active)
        if replicas is not None:
            replicas.release()
        placed = [*zip(range(len(selected)), [("feature", int(i)) for i in selected]),
                  *zip(range(n_nodes - len(output_keys), n_nodes), output_keys)]
        graph = _graph(model, prompt, tokens, transcoders, state, selected, outputs, adjacency)
        if not head_loadings:
            return graph
        keys = dict(placed)
        if head_loadings in (True, "all"):
            edges, kept = (graph.adjacency_matrix != 0).nonzero(), torch.ones(graph.n_nodes, dtype=torch.bool)
        else:
            pruned = graph.prune(node_threshold, edge_threshold)
            edges, kept = pruned.edge_mask.nonzero(), pruned.node_mask
        if written_out:
            head_gradients = backward.head_gradients
        else:
            head_gradients = functools.partial(_head_gradients, replicas.full)
        return split_attention(state, head_gradients, graph, edges, kept, lambda node: target(keys[node]), selected, qk,
                               batch_size, track)


def _head_gradients(replica: Replica, targets: list[Target]) -> list[Tensor]:
    """Autograd's gradients of `targets` at each layer's head outputs, over the frozen forward."""
    return replica.head_gradients(*directions(replica, targets))


def _active_encoders(transcoders, active: Tensor, dtype: torch.dtype) -> dict[tuple[int, int], Tensor]:
    """(layer, feature) -> the encoder direction of each active feature, read a layer at a time (a lazily
    loaded set reads only these columns)."""
    directions = {}
    for layer in active[:, 0].unique().tolist():
        ids = active[active[:, 0] == layer, 2].unique()
        columns = transcoders.encoder_columns(layer, ids).detach().to(dtype)
        directions.update(((layer, f), columns[:, j]) for j, f in enumerate(ids.tolist()))
    return directions


def salient_targets(model, state: Prompt, desired_logit_prob: float, max_n_logits: int) -> list[OutputTarget]:
    """The most probable next tokens, as output nodes (circuit-tracer's default targets)."""
    tokens, probs = state.salient_logits(desired_logit_prob, max_n_logits)
    vocab, seq = state.logits.shape[-1], state.tokens.shape[1]
    try:
        names = model.to_str_tokens(tokens)
    except ValueError:  # no tokenizer: the ids stand for themselves
        names = [str(t) for t in tokens.tolist()]
    outputs = []
    for token, prob, name in zip(tokens.tolist(), probs.tolist(), names):
        direction = -torch.full((vocab,), 1.0 / vocab)  # the logit minus the mean logit
        direction[token] += 1
        outputs.append(OutputTarget(name, token, seq - 1, direction, prob))
    return outputs


def _graph(model, prompt, tokens, transcoders, state: Prompt, selected: Tensor, outputs: list[OutputTarget],
           adjacency: Tensor) -> AttributionGraph:
    try:
        str_tokens = model.to_str_tokens(tokens[0])
        names = [o.name for o in outputs]
    except ValueError:  # no tokenizer: the ids stand for themselves
        str_tokens, names = [str(t) for t in tokens[0].tolist()], []
    # A target that is not one token gets an id of its own, below every token's.
    custom = iter(range(-1, -len(outputs) - 1, -1))
    ids = [o.token if o.token >= 0 else next(custom) for o in outputs]
    seq = tokens.shape[1]
    positions = [o.pos for o in outputs]
    return AttributionGraph(
        tokens=tokens[0].cpu(), active_features=state.active[selected].cpu(),
        activation_values=state.activations[selected].detach().cpu(),
        logit_tokens=torch.tensor(ids, dtype=torch.long),
        logit_probabilities=torch.tensor([o.weight for o in outputs], dtype=adjacency.dtype),
        adjacency_matrix=adjacency.detach().cpu(), n_layers=transcoders.n_layers,
        prompt=prompt if isinstance(prompt, str) else "", str_tokens=str_tokens,
        model_name=str(getattr(model.cfg, "model_name", "")), transcoder_names=transcoder_names(transcoders),
        logit_str_tokens=names,
        logit_positions=None if all(p == seq - 1 for p in positions) else torch.tensor(positions, dtype=torch.long))


class _Rows:
    """The computed rows, written in place into one matrix allocated up front: the graph's adjacency when
    every feature is computed (`at`: each key's row there), else [output + budget, source] in the order
    computed, with each row's sum of absolute values (its normalisation in the ranking, taken once)."""

    def __init__(self, out: Tensor, at: dict | None = None):
        self.out, self.at, self.fixed = out, at if at is not None else {}, at is not None
        self.keys: list = []
        self.abs_sums = torch.zeros(0 if self.fixed else out.shape[0], dtype=torch.float32)

    def place(self, keys: list, device: torch.device) -> tuple[Tensor, Tensor | None]:
        """The rows where `keys` go (registered in computed order), and, where they are consecutive (a
        chunk of features in `active`'s order, or of appended rows) and the rows are computed on `out`'s
        device (the CPU's: a model elsewhere computes them there and they are copied), those rows of `out`
        as one block to be written in place (still zero: each key is computed once), so that no [batch
        source] copy is allocated and copied per backward pass; else None."""
        if not self.fixed:
            for key in keys:
                self.at[key] = len(self.keys)
                self.keys.append(key)
        index = [self.at[key] for key in keys]
        in_place = index == list(range(index[0], index[0] + len(index))) and self.out.device == device
        return torch.tensor(index), self.out[index[0]:index[-1] + 1] if in_place else None

    def add(self, index: Tensor, rows: Tensor, written: bool = False) -> None:
        """Rows computed for `place`'s index: copied there unless `written` there already (its block)."""
        if not written:
            self.out[index, :rows.shape[1]] = rows
        if not self.fixed:
            self.abs_sums[index] = rows.abs().sum(1, dtype=torch.float32)

    def assembled(self, selected: Tensor, output_keys: list, n_active: int, chunk: int = 256) -> Tensor:
        """The adjacency over the selected features ([node node]: their rows and the outputs', the other
        features' columns dropped), gathered a chunk of rows at a time (no second [row source] copy)."""
        columns = torch.cat([selected, torch.arange(n_active, self.out.shape[1])])
        n_nodes = len(columns) + len(output_keys)
        adjacency = torch.zeros(n_nodes, n_nodes, dtype=self.out.dtype)
        rows = [self.at[("feature", int(i))] for i in selected] + [self.at[key] for key in output_keys]
        targets = [*range(len(selected)), *range(n_nodes - len(output_keys), n_nodes)]
        for start in range(0, len(rows), chunk):
            index = torch.tensor(rows[start:start + chunk])
            adjacency[targets[start:start + chunk], :len(columns)] = self.out[index[:, None], columns]
        self.out = None
        return adjacency


def _select_features(computed: _Rows, logit_probs: Tensor, n_active: int, budget: int, batch_size: int,
                     compute, update_interval: int = 4) -> Tensor:
    """circuit-tracer's feature selection (`_run_attribution`): rank the features by their influence on
    the logits through the rows computed so far, compute the `update_interval` batches of the most
    influential not yet computed, repeat until `budget` are (ties ordered as circuit-tracer's argsort
    orders them). Only the computed rows are held ([computed source], never a dense [source source])."""
    visited = torch.zeros(n_active, dtype=torch.bool)
    n_outputs, done = len(logit_probs), 0
    while done < budget:
        n = n_outputs + done
        own = torch.tensor([-1] * n_outputs + [key[1] for key in computed.keys[n_outputs:n]], dtype=torch.long)
        weights = torch.cat([logit_probs.float().cpu(), torch.zeros(done)])
        influence = _influence_of_rows(computed.out[:n], computed.abs_sums[:n], own, weights, n_active)
        rank = influence.argsort(descending=True)
        take = rank[~visited[rank]][:min(update_interval * batch_size, budget - done)]
        compute([("feature", i) for i in take.tolist()])
        visited[take] = True
        done += len(take)
    return visited.nonzero().flatten()


def _influence_of_rows(rows: Float[Tensor, "row source"], abs_sums: Float[Tensor, " row"],
                       own_column: Int[Tensor, " row"], weights: Float[Tensor, " row"],
                       n_columns: int, chunk: int = 256) -> Float[Tensor, " column"]:
    """The first `n_columns` of `_influence` of a graph of which only these rows are nonzero, each scaled to
    sum 1 in absolute value (`abs_sums`: their sums): row r is node `own_column[r]` as a source (-1: a
    logit, no source), `weights` the rows' output weights. The series w N + w N^2 + ... is
    (w + a) N, a the influence on the rows' own nodes, which only the [row row] block of N carries: a is
    summed over that small block, then one pass over the rows (a chunk at a time, their absolute values
    never held whole)."""
    scale = 1.0 / abs_sums.clamp(min=1e-10)
    is_source = (own_column >= 0).nonzero().flatten()
    block = rows[:, own_column[is_source]].abs().float() * scale[:, None]  # [row, computed feature]
    at, reached = weights, torch.zeros_like(weights)
    for _ in range(rows.shape[0]):  # a path visits each row once at most: the series ends by then
        current = at @ block
        if not bool(current.any()):
            break
        at = torch.zeros_like(weights)
        at[is_source] = current
        reached += at
    v = (weights + reached) * scale
    influence = torch.zeros(n_columns)
    used = v.nonzero().flatten()
    for start in range(0, len(used), chunk):
        index = used[start:start + chunk]
        influence += v[index] @ rows[index, :n_columns].abs().float()
    return influence
