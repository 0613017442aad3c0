"""Prefix replicas (hooked_models/attribution/replacement.py's `Replicas`): a chunk of targets that read only
the first positions runs its backward pass over a replica of those positions, which must give the rows the
whole prompt's replica gives (the oracle tests pin those), on both families (alpha-er's MLPs are routed by
the sequence's length: the prefix's MLP outputs are the whole prompt's) and a cross-layer transcoder."""

import torch

from hooked_models.attribution import attribute
from hooked_models.attribution.replacement import Prompt, Replicas, prompt_tokens
from hooked_models.attribution.targets import Target, target_rows


def test_a_prefix_replica_gives_the_whole_prompts_rows(family_setup):
    model, tcs, prompt = family_setup
    state = Prompt(model, prompt_tokens(model, prompt), tcs)
    replicas = Replicas(state, step=4)
    prefix = replicas(replicas.length(2))
    assert prefix is not replicas.full and prefix.length == 4  # used, not fallen back from
    early = [(l, p, f) for l, p, f in state.active.tolist() if p < 4]
    assert len({l for l, _, _ in early}) == tcs.n_layers  # targets at every layer
    targets = [Target(l, p, tcs.encoder(l).detach()[:, f]) for l, p, f in early]
    rows = target_rows(prefix, targets)
    torch.testing.assert_close(rows, target_rows(replicas.full, targets), rtol=1e-6, atol=1e-7)
    n_active, n_layers, seq = state.active.shape[0], tcs.n_layers, prompt.shape[0]
    errors = rows[:, n_active:n_active + n_layers * seq].view(len(targets), n_layers, seq)
    assert rows[:, :n_active][:, state.active[:, 1] >= 4].abs().max() == 0  # nothing after the prefix
    assert errors[..., 4:].abs().max() == 0 and rows[:, -seq:][:, 4:].abs().max() == 0
    assert rows.abs().max() > 0


def test_the_graph_over_prefixes_is_the_graph_over_the_whole_prompt(family_setup, monkeypatch):
    model, tcs, prompt = family_setup
    longer = torch.cat([prompt, prompt.flip(0)])  # 16 positions: the first chunks run over 8
    built, reproduces = [], Replicas._reproduces

    def spied(self, prefix):
        built.append((prefix.length, reproduces(self, prefix)))
        return built[-1][1]

    monkeypatch.setattr(Replicas, "_reproduces", spied)
    graph = attribute(model, longer, tcs, batch_size=8, head_loadings=False)
    assert built == [(8, True)]  # one prefix, used
    monkeypatch.setattr(Replicas, "length", lambda self, last_position: self.seq)  # every chunk over all 16
    whole = attribute(model, longer, tcs, batch_size=8, head_loadings=False)
    # float32 rounding: other shapes of the backward's products (alpha-er's: 3e-7 on one edge in 0.4 million)
    rounding = 1e-6 * float(whole.adjacency_matrix.abs().max())
    torch.testing.assert_close(graph.adjacency_matrix, whole.adjacency_matrix, rtol=1e-6, atol=rounding)
