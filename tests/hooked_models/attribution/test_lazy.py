"""Transcoders loaded lazily (`load_transcoders(dir, lazy=True)`) answer as the resident set they were saved
from, value for value, and the attribution graph through them is the resident one's bit for bit (edges, head
loadings, QK tables), while at most one layer's whole transcoder is alive at a time and only the active
features' encoder columns and decoder rows are otherwise read."""

import gc
import weakref

import pytest
import torch

from hooked_models.attribution import attribute
from hooked_models.transcoders import LazyTranscoderSet, TranscoderSet, load_transcoders

PER_LAYER = ["arcee", "alpha_er"]


@pytest.fixture(params=PER_LAYER)
def saved(request, tl_model_factory, make_untied, tmp_path):
    model = tl_model_factory(request.param)
    resident = make_untied(model, "per_layer", seed=5)
    resident.save(tmp_path / "tc")
    prompt = torch.randint(0, model.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(4))
    return model, resident, tmp_path / "tc", prompt


def test_a_lazy_set_answers_as_the_resident_one(saved):
    model, resident, path, prompt = saved
    lazy = load_transcoders(path, model=model, lazy=True)
    assert isinstance(lazy, LazyTranscoderSet) and isinstance(lazy, TranscoderSet)
    assert list(lazy.parameters()) == []  # nothing resident
    assert (lazy.n_layers, lazy.d_in, lazy.d_transcoder, lazy.d_out, lazy.activation, lazy.has_skip) == (
        resident.n_layers, resident.d_in, resident.d_transcoder, resident.d_out, resident.activation, resident.has_skip)
    x = torch.randn(8, resident.d_in, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([7, 0, 31, 7])
    for layer in range(resident.n_layers):
        acts = resident.encode(layer, x)
        assert torch.equal(lazy.encode(layer, x), acts)
        assert torch.equal(lazy.decode_to(layer, {layer: acts}, x), resident.decode_to(layer, {layer: acts}, x))
        none = {layer: torch.zeros(1, resident.d_transcoder)}  # no feature active: bias and skip, decoder unread
        assert torch.equal(lazy.decode_to(layer, none, x), resident.decode_to(layer, none, x))
        assert torch.equal(lazy.encoder_columns(layer, ids), resident.encoder(layer)[:, ids])
        assert torch.equal(lazy.decoder_rows(layer, layer, ids), resident.decoder(layer, layer)[ids])
        assert torch.equal(lazy.decoder(layer, layer), resident.decoder(layer, layer))
        assert torch.equal(lazy[layer].W_skip, resident[layer].W_skip)
    lazy.save(path.parent / "again")  # written a layer at a time, read back whole: the same set
    again = load_transcoders(path.parent / "again", model=model)
    assert lazy.k == resident.k and all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                                          resident.state_dict().values()))
    assert lazy.to(dtype=torch.float64).encode(0, x.double()).dtype == torch.float64


def test_the_graph_through_a_lazy_set_is_the_resident_ones_bit_for_bit(saved, monkeypatch):
    model, resident, path, prompt = saved
    kwargs = dict(max_feature_nodes=40, batch_size=8, head_loadings="pruned", qk=4)
    expected = attribute(model, prompt, resident, **kwargs)
    lazy = load_transcoders(path, model=model, lazy=True)

    alive, reads, original = [], [], LazyTranscoderSet._read

    def counted(self, layer):  # every whole layer read, and how many read earlier are alive at that moment
        gc.collect()
        reads.append((layer, sum(ref() is not None for ref in alive)))
        tc = original(self, layer)
        alive.append(weakref.ref(tc))
        return tc

    monkeypatch.setattr(LazyTranscoderSet, "_read", counted)
    graph = attribute(model, prompt, lazy, **kwargs)
    assert torch.equal(graph.adjacency_matrix, expected.adjacency_matrix)
    assert torch.equal(graph.active_features, expected.active_features)
    for name in ("loading_edges", "loading_heads", "loading_skips"):
        assert torch.equal(getattr(graph, name), getattr(expected, name)), name
    assert graph.qk_tables.keys() == expected.qk_tables.keys() and graph.qk_tables
    for key, table in expected.qk_tables.items():
        mine = graph.qk_tables[key]
        assert mine.names == table.names and torch.equal(mine.queries, table.queries), key
        assert torch.equal(mine.keys, table.keys) and mine.model_score == table.model_score, key
    # each layer read whole once (its encode and decode), and never while another layer's is alive
    assert [layer for layer, _ in reads] == list(range(model.cfg.num_layers))
    assert all(others == 0 for _, others in reads)


def test_bad_input_to_a_lazy_set_is_refused_by_name(saved, tmp_path, tl_model_factory, make_untied):
    model, resident, path, prompt = saved
    lazy = load_transcoders(path, model=model, lazy=True)
    with pytest.raises(ValueError, match=r"feature ids must lie in \[0, 32\)"):
        lazy.decoder_rows(0, 0, [32])
    with pytest.raises(ValueError, match="writes only layer 0's MLP output, not layer 1's"):
        lazy.decoder_rows(0, 1, [0])
    with pytest.raises(ValueError, match="layer=5 is not a layer"):
        lazy.encoder_columns(5, [0])
    clt = make_untied(tl_model_factory("arcee"), "clt")
    clt.save(tmp_path / "clt")
    with pytest.raises(ValueError, match="lazy=True reads per-layer sets"):
        load_transcoders(tmp_path / "clt", lazy=True)
    other = make_untied(model, "per_layer", d_transcoder=16)
    other.save(tmp_path / "other")
    (path / "layer_1.safetensors").write_bytes((tmp_path / "other" / "layer_1.safetensors").read_bytes())
    with pytest.raises(ValueError, match="a set's transcoders share their shape"):
        load_transcoders(path, lazy=True)
