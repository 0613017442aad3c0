"""Fixtures for the attribution package's tests: random models of both families (GQA Arcee) with untied
random transcoders, and an oracle of the linear replacement model written here, sharing none of the
package's code: the model run with its norm scales and patterns written back as the prompt's, each MLP's
output its clean value plus what the transcoder's skip connection moves (the features and errors fixed),
so that anything written on top of it (a source's write doubled, a head held) moves the rest linearly."""

from types import SimpleNamespace

import pytest
import torch

from hooked_models.transcoders import CrossLayerTranscoder, Transcoder, TranscoderSet

SEQ = 8  # a multiple of alpha-er's experts


def untied_transcoders(model, kind: str = "per_layer", seed: int = 0, d_transcoder: int = 32):
    """Random transcoders whose encoders are not their decoders' transposes (every weight and bias drawn
    on its own, skip connections on), with enough features active for a graph."""
    d, n = model.cfg.hidden_size, model.cfg.num_layers
    if kind == "per_layer":
        tcs = TranscoderSet([Transcoder(d, d_transcoder, layer=l, skip=True) for l in range(n)], model=model)
    else:
        tcs = CrossLayerTranscoder(n, d, d_transcoder, skip=True, model=model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tcs.named_parameters():
            scale = {"b_enc": 0.3, "b_dec": 0.1, "W_skip": 0.1}.get(name.split(".")[-1], 1.0 / d**0.5)
            p.copy_(scale * torch.randn(p.shape, generator=generator))
            if name.endswith("b_enc"):
                p.add_(0.2)
    return tcs


def frozen(name: str) -> bool:
    return name.endswith(".norm_scale") or name.endswith(".attention_probabilities")


class Replacement:
    """The linear replacement model of one prompt, run forward by hand through the model's hooks."""

    def __init__(self, model, tcs, tokens):
        self.model, self.tcs, self.tokens = model, tcs, tokens
        self.inputs = [tcs.input_hook(l) for l in range(tcs.n_layers)]
        self.outputs = [tcs.output_hook(l) for l in range(tcs.n_layers)]
        with torch.no_grad():
            _, cache = model.run_with_cache(
                tokens[None], names_filter=lambda n: frozen(n) or n in self.inputs or n in self.outputs
                or n.endswith("attention_head_outputs") or n == "layers.0.layer_input")
        self.cache = cache
        self.x = [cache[n][0] for n in self.inputs]
        self.acts = [tcs.encode(l, x) for l, x in enumerate(self.x)]

    def write(self, layer: int, pos: int, feature: int) -> torch.Tensor:
        """[layer hidden_size]: what feature (layer, pos, feature) writes to each MLP output."""
        a = self.acts[layer][pos, feature]
        rows = []
        for t in range(self.tcs.n_layers):
            if isinstance(self.tcs, CrossLayerTranscoder):
                rows.append(a * self.tcs.W_dec[layer][feature, t - layer] if t >= layer else torch.zeros_like(self.x[0][0]))
            else:
                rows.append(a * self.tcs[layer].W_dec[feature] if t == layer else torch.zeros_like(self.x[0][0]))
        return torch.stack(rows)

    def run(self, extra: dict | None = None, hooks=(), names=(), zero_sources: bool = False,
            keep_position_zero: bool = False) -> SimpleNamespace:
        """The frozen replacement forward with `extra[(layer, pos)]` [hidden_size] added to MLP outputs:
        every transcoder's pre-activations [layer seq d_transcoder], the logits [seq vocab] (`raw`) and
        demeaned, and the values named. `zero_sources`: every node zero (embeddings, features, errors),
        what is left being the biases' part; position 0's features and errors are not nodes unless
        `keep_position_zero` (attribute's default), so its MLP writes stay at their values there."""
        extra, live = extra or {}, {}

        def read(t, hook, l):
            live[l] = t[0]

        def out(t, hook, l):
            if isinstance(self.tcs, CrossLayerTranscoder):
                moved = self.tcs.skip(l, live[l]) - self.tcs.skip(l, self.x[l])
            else:
                moved = self.tcs[l].skip(live[l]) - self.tcs[l].skip(self.x[l])
            value = self.cache[self.outputs[l]][0] + moved
            if zero_sources:  # b_dec and the skip connection of the live input alone
                if isinstance(self.tcs, CrossLayerTranscoder):
                    bias = self.tcs.b_dec[l] + self.tcs.skip(l, live[l])
                else:
                    bias = self.tcs[l].b_dec + self.tcs[l].skip(live[l])
                value = bias if keep_position_zero else torch.cat([value[:1], bias[1:]])
            for (layer, pos), w in extra.items():
                if layer == l:
                    value = value.clone()
                    value[pos] += w
            return value[None]

        fwd = [(frozen, lambda t, hook: self.cache[hook.name].clone()), *hooks]
        for l in range(self.tcs.n_layers):
            fwd += [(self.inputs[l], lambda t, hook, l=l: read(t, hook, l)),
                    (self.outputs[l], lambda t, hook, l=l: out(t, hook, l))]
        if zero_sources:
            fwd.append(("layers.0.layer_input", lambda t, hook: torch.zeros_like(t)))
        captured = {}
        fwd += [(n, lambda t, hook: captured.__setitem__(hook.name, t[0].clone())) for n in names]
        with torch.no_grad():
            logits = self.model.run_with_hooks(self.tokens[None], fwd_hooks=fwd)[0]
            pre = torch.stack([self.tcs.encode(l, live[l], apply_activation=False) for l in range(self.tcs.n_layers)])
        return SimpleNamespace(pre=pre, logits=logits - logits.mean(-1, keepdim=True), raw=logits, values=captured)


# The cases: (family, transcoders) by id.
CASES = {"arcee": ("arcee", "per_layer"), "alpha_er": ("alpha_er", "per_layer"), "arcee_clt": ("arcee", "clt")}


@pytest.fixture(scope="module", params=list(CASES))
def family_setup(request, tl_model_factory):
    """(model, transcoders, tokens) for both families and a cross-layer transcoder."""
    family, kind = CASES[request.param]
    model = tl_model_factory(family)
    prompt = torch.randint(0, model.cfg.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(3))
    return model, untied_transcoders(model, kind), prompt


@pytest.fixture(scope="session")
def replacement():
    """The oracle class (tests cannot import conftest under importlib mode)."""
    return Replacement


@pytest.fixture(scope="session")
def make_untied():
    return untied_transcoders


def _node_values(graph, run):
    """Each node's value in the graph's row order: features' pre-activations, outputs' logits."""
    values = torch.full((graph.n_nodes,), float("nan"))
    layer, pos, feature = graph.active_features.T
    values[:graph.n_features] = run.pre[layer, pos, feature]
    values[graph.logit_start:] = run.logits[-1, graph.logit_tokens]
    return values


@pytest.fixture(scope="session")
def node_values():
    """A graph's nodes' values in a run of the oracle (the head-loading and QK-flow tests)."""
    return _node_values
