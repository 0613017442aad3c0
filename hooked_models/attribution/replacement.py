"""The replacement model of one prompt: its clean run seen through the transcoders, and the frozen copies
that backward passes run through.

Every MLP is replaced by its transcoder plus an error term (what the transcoder misses at that layer and
position), and the prompt's attention patterns and norm scales are frozen at their values: what remains
from the embeddings, the features' decoder writes and the errors to the encoders' inputs and the logits
is linear. Everything goes through the model's hooks, so both families are handled alike: every
`norm_scale` (RMS and LayerNorm, alpha-er's bottleneck norms and its lm_head's) is frozen by returning
its `detach()` (hooked_models/components/norms.py honours that), every `attention_probabilities`
likewise, which also linearises alpha-er's soft cap (it only shapes the pattern) and its factored
projections (linear once their bottleneck norm is frozen). The MLP outputs are constants of the prompt
but for a transcoder's skip connection, which is linear and stays on the path.
"""

import bisect
from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from hooked_models.transcoders import CrossLayerTranscoder


def is_frozen(name: str) -> bool:
    """The values frozen at the prompt's: every norm's scale and every attention pattern."""
    return name.endswith(".norm_scale") or name.endswith(".attention_probabilities")


def freezing_hooks() -> list:
    """Every norm scale and attention pattern frozen at its value: returned detached, which the
    components honour (the forward keeps its bits, the gradient treats them as constants)."""
    return [(is_frozen, lambda t, hook: t.detach())]


def transcoder_names(transcoders) -> list[str]:
    return [transcoders.input_hook(l) for l in range(transcoders.n_layers)]


def written_layers(transcoders, layer: int) -> range:
    """The layers whose MLP output layer `layer`'s features write: itself, or (a cross-layer
    transcoder, whose `decoder(source, target)` takes any later target) it and every later one."""
    if isinstance(transcoders, CrossLayerTranscoder):
        return range(layer, transcoders.n_layers)
    return range(layer, layer + 1)


def bias_and_skip(transcoders, layer: int, x: Tensor) -> Tensor:
    """What layer `layer`'s transcoder writes with no feature active: its b_dec plus its skip connection
    of its input x (where it has one), broadcast against x; no [... d_transcoder] product is formed."""
    if isinstance(transcoders, CrossLayerTranscoder):
        none = {}  # a source layer missing from the mapping contributes nothing
    else:
        none = {layer: torch.zeros(1, transcoders.d_transcoder, dtype=x.dtype, device=x.device)}
    return transcoders.decode_to(layer, none, x if transcoders.has_skip else None)


def _skip_gradient(transcoders, layer: int, x: Tensor) -> Tensor:
    """An exact zero whose gradient is that of layer `layer`'s skip connection of its input x: added
    to the MLP's clean output, it keeps the output's bits and the skip's linear path."""
    return bias_and_skip(transcoders, layer, x) - bias_and_skip(transcoders, layer, x.detach()).detach()


class Prompt:
    """The prompt's clean run seen through the transcoders: their inputs, features, and errors. With
    `frozen`, run with the freezing hooks (which keep every value but send attention down its explicit
    path, as in the frozen runs that follow), so that the values here are theirs bit for bit.

    `keep_position_zero=False` (what `attribute` passes by default): position 0's features are not among
    the active ones and its errors are zero, as circuit-tracer's `zero_positions` has them; what its MLPs
    write there beyond each transcoder's bias and skip is `held` [layer seq d_out], a constant of the prompt
    beside the biases (zero at every other position, and everywhere when position 0 is kept, the default
    here: interventions read the true errors)."""

    def __init__(self, model, tokens: Tensor, transcoders, frozen: bool = True, keep_position_zero: bool = True):
        self.model, self.tokens, self.transcoders = model, tokens, transcoders
        self.keep_position_zero = keep_position_zero
        n = transcoders.n_layers
        self.inputs = [transcoders.input_hook(l) for l in range(n)]
        self.outputs = [transcoders.output_hook(l) for l in range(n)]
        with torch.no_grad(), model.hooks(fwd_hooks=freezing_hooks() if frozen else []):
            values = [f"layers.{l}.self_attn.attention_values" for l in range(model.cfg.num_layers)]
            wanted = {*self.inputs, *self.outputs, "layers.0.layer_input", *values}
            # (A hook on the patterns sends attention down its explicit path: only when frozen.)
            self.logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n in wanted or (frozen and is_frozen(n)))
            # The frozen values ([1 ...] each: patterns, norm scales), for runs that write them back.
            self.constants = {name: value for name, value in cache.items() if is_frozen(name)}
            self.values = [cache[name][0] for name in values]  # [kv_head seq head_dim] per layer
            dtype = transcoders.dtype
            self.x = [cache[name][0].to(dtype) for name in self.inputs]
            self.mlp_out = [cache[name][0] for name in self.outputs]
            self.acts, self.recons = [], []
            for l, x in enumerate(self.x):  # layer by layer, so that a lazily loaded set reads each layer once
                self.acts.append(transcoders.encode(l, x))
                self.recons.append(transcoders.decode_to(l, self.acts, x if transcoders.has_skip else None))
            self.errors = torch.stack([o.to(dtype) - r for o, r in zip(self.mlp_out, self.recons)])
            self.embedding = cache["layers.0.layer_input"][0].to(dtype)
            self.held = torch.zeros_like(self.errors)
            acts = torch.stack(self.acts)
            if not keep_position_zero:
                # The BOS position's activations are an artefact of its attention-sink role, large and
                # alike on every prompt: circuit-tracer zeroes them (and the error there) for the BOS it
                # prepends. Its whole MLP write beyond bias and skip is held as a constant instead.
                self.held[:, 0] = torch.stack([o[0].to(dtype) - bias_and_skip(transcoders, l, x[:1])[0]
                                               for l, (o, x) in enumerate(zip(self.mlp_out, self.x))])
                self.errors[:, 0] = 0
                acts = acts.clone()
                acts[:, 0] = 0
        active = acts.nonzero()  # (layer, position, feature), in that order
        self.active = active
        self._writes = None
        self.activations = acts[tuple(active.T)]

    def feature_writes(self) -> list[tuple[int, list[int], list[int], dict[int, Tensor], Tensor]]:
        """Per layer, where its features write, for `rows_of` and the decomposition: the first of its rows
        in `active` (nonzero() ordered them by layer, then position), the positions that have active
        features, how many rows each has, for each layer t written the features' decoder rows at t laid out
        [position most d_out] (each position's rows in `active`'s order, padded with zeros to the most any
        position has: one batched product per layer reads them), and where each of the layer's rows sits
        in that layout flattened ([position x most]).
        Computed once per prompt (every backward pass reads them)."""
        if self._writes is None:
            tcs, dtype = self.transcoders, self.errors.dtype
            self._writes = []
            for layer in range(tcs.n_layers):
                rows = (self.active[:, 0] == layer).nonzero().flatten()
                start = int(rows[0]) if rows.numel() else 0
                pos, ids = self.active[rows, 1], self.active[rows, 2]
                positions, counts = pos.unique_consecutive(return_counts=True)
                most = int(counts.max()) if rows.numel() else 0
                first = counts.cumsum(0) - counts
                where = (torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts) * most
                         + torch.arange(len(rows), device=counts.device) - torch.repeat_interleave(first, counts))
                decoders = {}
                for t in (written_layers(tcs, layer) if rows.numel() else ()):
                    compact = tcs.decoder_rows(layer, t, ids).to(dtype)
                    decoders[t] = compact.new_zeros(len(counts) * most, compact.shape[-1])
                    decoders[t][where.to(compact.device)] = compact
                    decoders[t] = decoders[t].view(len(counts), most, -1)
                    del compact
                self._writes.append((start, positions.tolist(), counts.tolist(), decoders, where))
        return self._writes

    def decoder_row(self, index: int, target: int) -> Tensor:
        """Active feature `index`'s decoder row into layer `target`'s MLP output (from `feature_writes`)."""
        start, _, _, decoders, where = self.feature_writes()[int(self.active[index, 0])]
        return decoders[target].flatten(0, 1)[where[index - start]]

    def salient_logits(self, desired_logit_prob: float, max_n_logits: int) -> tuple[Tensor, Tensor]:
        """The most probable next tokens until their probabilities reach `desired_logit_prob`, at most
        `max_n_logits` (circuit-tracer's `compute_salient_logits`)."""
        probs = torch.softmax(self.logits[0, -1].float(), -1)
        top = probs.sort(descending=True)
        k = int(torch.searchsorted(top.values.cumsum(0), desired_logit_prob)) + 1
        k = min(k, max_n_logits, probs.shape[0])
        return top.indices[:k], top.values[:k]


class Replica:
    """The prompt run once with everything frozen, kept for backward passes, each of which computes
    the rows of many targets at once: their directions are batched gradients (autograd's
    `is_grads_batched`, a vmap over one forward's graph), so no copy of the prompt is run forward (the
    copies' forward, MLPs included, was 42% of the CPU time on an 8 x 1024 Arcee).

    Leaves where the sources write (the stream entering layer 0, each MLP output) and the values the
    targets read (each transcoder's input, the logits). The MLP outputs are their clean values, held as
    leaves, plus the transcoders' skip connections (linear, so on the path).

    `length`: a replica of the prompt's first `length` positions (`Replicas`), its frozen values and
    MLP outputs the whole prompt's there, not its own run's (which other shapes of matrix products
    round otherwise, and an MLP routed by the sequence's length computes otherwise): the backward
    passes read only those, so they meet the same numbers as the whole prompt's."""

    def __init__(self, prompt: Prompt, length: int | None = None):
        model, tcs = prompt.model, prompt.transcoders
        tokens = prompt.tokens if length is None else prompt.tokens[:, :length]
        self.length = n = tokens.shape[1]
        self.prompt, self.reads, self.out_leaves, self.head_outputs = prompt, {}, {}, {}
        self.embedding_leaf = None
        self.substituted = True  # every frozen value of a prefix replica was the prompt's

        def frozen(t, hook):
            if length is None:
                return t.detach()
            value = prompt.constants.get(hook.name)
            value = None if value is None else value[:, :n] if hook.name.endswith(".norm_scale") else value[..., :n, :n]
            if value is None or value.shape != t.shape:
                self.substituted = False
                return t.detach()
            return value

        def embedding(t, hook):
            self.embedding_leaf = t.detach().requires_grad_()
            return self.embedding_leaf

        def read(t, hook, layer):
            self.reads[layer] = t

        def write(t, hook, layer):
            clean = t if length is None else prompt.mlp_out[layer][None, :n].to(t.dtype)
            leaf = clean.detach().requires_grad_()
            self.out_leaves[layer] = leaf
            if not tcs.has_skip:
                return leaf
            skip = _skip_gradient(tcs, layer, self.reads[layer].to(tcs.dtype))
            return leaf + skip.to(t.dtype)

        def heads(t, hook, layer):
            self.head_outputs[layer] = t

        hooks = [(is_frozen, frozen), ("layers.0.layer_input", embedding)]
        for l in range(tcs.n_layers):
            hooks += [(prompt.inputs[l], lambda t, hook, l=l: read(t, hook, l)),
                      (prompt.outputs[l], lambda t, hook, l=l: write(t, hook, l))]
            hooks.append((f"layers.{l}.self_attn.attention_head_outputs", lambda t, hook, l=l: heads(t, hook, l)))
        # No parameter gradients, the model's or the transcoders': the graph is built for the leaves alone.
        params = [p for module in (model, tcs) for p in module.parameters() if p.requires_grad]
        try:
            for p in params:
                p.requires_grad_(False)
            with torch.enable_grad():
                self.logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
        finally:
            for p in params:
                p.requires_grad_(True)

    def columns(self, grad_inputs: dict, grad_logits: Tensor | None, out: Tensor | None = None) -> Tensor:
        """Rows of the adjacency for the targets whose input directions are given: `grad_inputs[l]`
        [batch seq d_in] at transcoder l's input, `grad_logits` [batch seq vocab] at the logits.
        Columns: features, errors, embeddings (logits, which write nothing, are left out). `out`: a block
        of zeros [batch >= sources] the rows are written into (its first columns returned), else new."""
        outputs = [self.reads[l] for l in grad_inputs] + ([self.logits] if grad_logits is not None else [])
        grads_out = [g.to(o.dtype) for g, o in zip([*grad_inputs.values(), grad_logits], outputs)]
        leaves = [self.embedding_leaf, *[self.out_leaves[l] for l in range(len(self.out_leaves))]]
        n = grads_out[0].shape[0]
        grads = torch.autograd.grad(outputs, leaves, [g[:, None] for g in grads_out], retain_graph=True,
                                    allow_unused=True, is_grads_batched=True)
        grads = [leaves[0].new_zeros(n, *leaves[0].shape[1:]) if grads[0] is None else grads[0][:, 0],
                 *[None if g is None else g[:, 0] for g in grads[1:]]]
        # The rows are numbers: under no_grad, so that no graph (through a transcoder's weights that
        # require grad) keeps this pass's gradients alive past it.
        with torch.no_grad():
            return self._rows_of(grads, out)

    def head_gradients(self, grad_inputs: dict, grad_logits: Tensor | None) -> list[Tensor]:
        """The targets' gradients at each layer's head outputs, [batch seq head head_dim] per layer: what
        a unit written there (through every later path) moves each target by."""
        outputs = [self.reads[l] for l in grad_inputs] + ([self.logits] if grad_logits is not None else [])
        grads_out = [g.to(o.dtype) for g, o in zip([*grad_inputs.values(), grad_logits], outputs)]
        heads = [self.head_outputs[l] for l in range(len(self.head_outputs))]
        n = grads_out[0].shape[0]
        grads = torch.autograd.grad(outputs, heads, [g[:, None] for g in grads_out], retain_graph=True,
                                    allow_unused=True, is_grads_batched=True)
        return [h.new_zeros(n, *h.shape[1:]) if g is None else g[:, 0].detach() for g, h in zip(grads, heads)]

    def _rows_of(self, grads: Sequence[Tensor | None], out: Tensor | None = None) -> Float[Tensor, "batch source"]:
        return rows_of(self.prompt, self.length, grads, out)


class Replicas:
    """The full replica, and a replica of a prefix for the targets that read only its positions: a
    target at position p reads nothing after p (causal attention), so its backward pass can run over
    positions 0..p alone, its rows zero past them (on an 8 x 1024 Arcee at 64 tokens, 45% of the CPU
    time). Its backward passes read the whole prompt's frozen values (`Replica(length=)`), so they
    meet the same numbers; it is used only where the model computes at that length and its forward
    gives the whole prompt's values there up to float32 rounding (a guard against a model whose
    prefix is not the prompt's). Each prefix is built once and held until `release()`: the feature
    selection comes back to the same lengths every few batches, and on a small model a prefix's forward
    cost more than its shorter backward passes saved when it was built anew each time (prefix lengths
    a quarter of the prompt apart hold at most 1.5 times the full replica's activations).

    `step`: prefix lengths are multiples of it (fewer forwards, longer backwards); 0: no prefixes."""

    def __init__(self, prompt: Prompt, step: int):
        self.full = Replica(prompt)
        self.seq, self.step = prompt.tokens.shape[1], step
        self.prefixes: dict[int, Replica] = {}

    def length(self, last_position: int) -> int:
        """The prefix length that a chunk of targets at positions up to `last_position` runs over."""
        if not self.step:
            return self.seq
        return min(self.seq, -(-(last_position + 1) // self.step) * self.step)

    def __call__(self, length: int) -> Replica:
        if length >= self.seq or not self.step:
            return self.full
        if length not in self.prefixes:
            if self.full.prompt.model.length_problem(length) is not None:
                self.prefixes[length] = self.full  # the model refuses this length: the whole prompt's
                return self.full
            prefix = Replica(self.full.prompt, length)
            if not self._reproduces(prefix):
                self.step = 0  # this model's prefixes are not the prompt's: full replicas from here on
                self.release()
                return self.full
            self.prefixes[length] = prefix
        return self.prefixes[length]

    def release(self) -> None:
        """Drop the prefixes' replicas (the full one stays)."""
        self.prefixes.clear()

    def _reproduces(self, prefix: Replica) -> bool:
        """The prefix's forward gives the full one's values at its positions, up to float32 rounding
        (matrix products of other shapes round otherwise): every leaf, every read, the logits."""
        full, n = self.full, prefix.length
        pairs = [(prefix.logits, full.logits), (prefix.embedding_leaf, full.embedding_leaf),
                 *[(prefix.reads[l], full.reads[l]) for l in full.reads],
                 *[(prefix.out_leaves[l], full.out_leaves[l]) for l in full.out_leaves]]
        pairs = [(a.detach(), b.detach()) for a, b in pairs]
        return prefix.substituted and all(a.dtype in (torch.float32, torch.float64) and a.shape == b[:, :n].shape
                   and float((a - b[:, :n]).abs().max()) <= 1e-5 * float(b[:, :n].abs().max()) for a, b in pairs)


def rows_of(prompt: Prompt, length: int, grads: Sequence[Tensor | None], out: Tensor | None = None
            ) -> Float[Tensor, "batch source"]:
    """The rows from the gradients at the leaves, [batch >= length d] each (None: a leaf the targets do
    not reach): the stream entering layer 0, then each MLP output. Each source's write dotted with its
    leaf's gradient, written into `out`'s first columns (zeros: only the nonzero parts are written) or a
    new matrix; the rows are zero past the first `length` positions (a prefix's)."""
    rows = RowWriter(prompt, length, grads[0].shape[0], grads[0].device, out)
    for leaf, g in enumerate(grads):
        if g is not None:
            rows.add(leaf, g)
    return rows.done()


def position_dots(g: Tensor, x: Tensor) -> Float[Tensor, "batch position"]:
    """g [batch position d] dotted with x [position d] at each position, as one batched product."""
    return torch.bmm(g.transpose(0, 1), x[:, :, None])[..., 0].T


class RowWriter:
    """`rows_of` one leaf at a time, in any order, each leaf's gradient free to go once `add` returns (a
    backward pass hands each over as it is made, and holds two gradients, not one per layer)."""

    def __init__(self, prompt: Prompt, length: int, n: int, device, out: Tensor | None = None):
        dtype = prompt.errors.dtype
        n_layers, seq = prompt.errors.shape[:2]
        n_active = prompt.active.shape[0]
        width = n_active + (n_layers + 1) * seq
        if out is None:
            self.rows = torch.zeros(n, width, dtype=dtype, device=device)
        elif out.shape[0] != n or out.shape[1] < width or out.dtype != dtype or out.device != torch.device(device):
            raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device}; the rows are {dtype} "
                             f"({n}, {width}) on {device}")
        else:
            self.rows = out[:, :width]
        self.prompt, self.length = prompt, length
        self.reached: dict[int, tuple[int, int]] = {}  # layer -> its features' columns the prefix holds
        self.features = self.rows[:, :n_active]
        self.errors = self.rows[:, n_active:n_active + n_layers * seq].view(n, n_layers, seq)
        self.embedding = self.rows[:, n_active + n_layers * seq:]

    def add(self, leaf: int, g: Tensor, first: int = 0) -> None:
        """Leaf `leaf`'s gradient [batch >= length-first d] at positions `first` ... (0: the stream entering
        layer 0, l + 1: layer l's MLP output): its sources' columns (those before `first` left as they are)."""
        prompt, length = self.prompt, self.length
        g = g[:, :length - first].to(prompt.errors.dtype)
        if leaf == 0:
            self.add_embedding(position_dots(g, prompt.embedding[first:length]), first)
            return
        t = leaf - 1
        self.errors[:, t, first:length] = position_dots(g, prompt.errors[t, first:length])
        for layer, (start, positions, counts, padded, where) in enumerate(prompt.feature_writes()):
            k = bisect.bisect_left(positions, length)  # the positions inside the prefix
            if not k or t not in padded:
                continue
            stop = start + sum(counts[:k])
            # One batched product per layer written, over the positions with features (nonzero() ordered
            # the rows by position), each position's decoder rows padded to the most any has: gathering the
            # gradient at each feature's position would copy [batch feature hidden_size], 10x slower, and a
            # product per position was thousands of small ones. Summed over the layers written in place.
            # (Positions before `first` have no features here: they are not carried.)
            if positions[k - 1] - positions[0] == k - 1:  # every position from the first: a view
                at = g[:, positions[0] - first:positions[0] - first + k]
            else:
                at = g[:, [p - first for p in positions[:k]]]
            # [batch (position most)], each target's row contiguous, read off at the features' places.
            products = torch.bmm(at.transpose(0, 1), padded[t][:k].transpose(1, 2)).transpose(0, 1).flatten(1)
            self.features[:, start:stop] += products[:, where[:stop - start].to(products.device)]
            self.reached[layer] = (start, stop)

    def add_embedding(self, dots: Tensor, first: int = 0) -> None:
        """The embedding's columns at positions `first` ... (the stream entering layer 0's gradient dotted
        with the embedding there, [batch length-first]), where a backward pass makes them without that
        gradient."""
        self.embedding[:, first:self.length] = dots.to(self.embedding.dtype)

    def done(self) -> Float[Tensor, "batch source"]:
        """The rows, each feature's column scaled by its activation."""
        for start, stop in self.reached.values():
            self.features[:, start:stop] *= self.prompt.activations[start:stop]
        return self.rows


def prompt_tokens(model, prompt) -> Tensor:
    """[1 seq] token ids of a string (tokenized whole: a prompt too long is refused, not truncated)
    or of ids given as a list or tensor."""
    if isinstance(prompt, str):
        return model.to_tokens(prompt, truncate=False)
    tokens = torch.as_tensor(prompt)
    if tokens.ndim == 2 and tokens.shape[0] == 1:
        tokens = tokens[0]
    if tokens.ndim != 1 or tokens.is_floating_point() or not tokens.numel():
        raise ValueError(f"prompt must be text or one sequence of token ids, got shape {tuple(tokens.shape)}")
    return tokens.long()[None].to(model.cfg.device)


def check_prompt(model, tokens: Tensor, transcoders) -> None:
    """The transcoders fit the model and the prompt fits its positions."""
    if transcoders.d_in != model.cfg.hidden_size or transcoders.d_out != model.cfg.hidden_size:
        raise ValueError(f"the transcoders read {transcoders.d_in}-wide inputs and write {transcoders.d_out}-wide "
                         f"outputs; this model's MLPs read and write hidden_size={model.cfg.hidden_size}")
    transcoders.check_model(model)
    if tokens.shape[1] > model.max_positions:
        raise ValueError(f"the prompt is {tokens.shape[1]} tokens; this model computes at most "
                         f"{model.max_positions} positions")
