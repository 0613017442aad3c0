"""Prefix replicas (hooked_models/attribution/replacement.py's `Replicas`): a chunk of targets that read only
the first positions runs its backward pass over a replica of those positions, which must give the rows the
whole prompt's replica gives (the oracle tests pin those), on both families (alpha-er's MLPs are routed by
the sequence's length: the prefix's MLP outputs are the whole prompt's) and a cross-layer transcoder."""

import importlib

import pytest
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
    # autograd's path, which the prefixes serve (an Arcee with per-layer transcoders takes the written-out
    # backward otherwise, which runs no forward per prefix: tests/.../test_linear_backward.py)
    monkeypatch.setattr(importlib.import_module("hooked_models.attribution.attribute"), "refusal",
                        lambda model, transcoders: "autograd's path, for the test")
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


def test_rows_written_in_place_are_the_rows_computed_anew(family_setup):
    """`target_rows(out=)`, as `attribute` calls it: the rows written into a strided block of a larger zero matrix
    (the adjacency's layout, wider than the sources) equal the rows computed into a new matrix, bit for bit, the
    columns past the sources untouched; an `out` of the wrong shape is refused, naming both shapes."""
    model, tcs, prompt = family_setup
    state = Prompt(model, prompt_tokens(model, prompt), tcs)
    replicas = Replicas(state, step=4)
    for replica in (replicas.full, replicas(replicas.length(2))):
        targets = [Target(l, p, tcs.encoder(l).detach()[:, f]) for l, p, f in state.active.tolist()[::3]
                   if p < replica.length]
        fresh = target_rows(replica, targets)
        matrix = torch.zeros(len(targets) + 2, fresh.shape[1] + 5)
        block = matrix[1:1 + len(targets)]
        written = target_rows(replica, targets, out=block)
        assert written.data_ptr() == block.data_ptr() and torch.equal(written, fresh)
        assert matrix[0].abs().max() == 0 and matrix[-1].abs().max() == 0 and matrix[:, -5:].abs().max() == 0
    with pytest.raises(ValueError, match=rf"out is torch.float32 \({len(targets)}, 3\).*\({len(targets)}, {fresh.shape[1]}\)"):
        target_rows(replicas.full, targets, out=torch.zeros(len(targets), 3))
