"""benchmarks/attribution_floor.py's counts against a hand count of the products on a tiny shape (hidden 4,
heads 2 over 1 key/value head of width 2, 3 layers, vocabulary 5, a transcoder skip 4 x 4): per position, an
output projection 4·2·2 = 16, a value projection 4·1·2 = 8, a skip 16."""

from types import SimpleNamespace

from benchmarks.attribution_floor import row_products, tight_row_products

CFG = SimpleNamespace(hidden_size=4, num_heads=2, num_kv_heads=1, head_dim=2, num_layers=3, vocab_size=5)
TCS = SimpleNamespace(d_in=4, d_out=4, has_skip=True)
SOURCES = 10  # each read off with a dot product of 4


def test_the_floor_counts_every_carried_position_of_every_layer_up_to_the_target():
    # A feature at layer 2 over 4 positions: attention 2, 1, 0 (16 + 8 each) and skips 1, 0 (16 each).
    assert row_products(CFG, TCS, 2, 4, SOURCES) == 4 * (3 * 24 + 2 * 16) + 40
    # A logit over 4 positions: every layer's attention and skip, and the unembedding 5 x 4.
    assert row_products(CFG, TCS, None, 4, SOURCES) == 4 * 3 * (24 + 16) + 20


def test_the_tight_count_skips_what_an_implementation_could():
    # A feature at layer 2, position 3, position 0 dropped (positions 1-3 carried):
    layer_2 = 16 + 16  # the output projection at position 3; 2 heads' [4] value vectors (16 < 3 x 8)
    layer_1 = 3 * 16 + 3 * 16 + 3 * 8  # skip 1, output and value projections at 3 positions
    layer_0 = 3 * 16 + 3 * 16 + 3 * 2  # skip 0, output projection; the value gradients dotted with the values
    zero = 2 * 2 + 2 * 2  # position 0's embedding: per head at layer 2, per key/value head at layers 1 and 0
    assert tight_row_products(CFG, TCS, 2, 3, SOURCES, position_zero=False) == layer_2 + layer_1 + layer_0 + zero + 40
    # Position 0 kept: 4 positions carried, no precomputed vectors.
    assert tight_row_products(CFG, TCS, 2, 3, SOURCES, position_zero=True) == (
        16 + 16 + 4 * 16 + 4 * 16 + 4 * 8 + 4 * 16 + 4 * 16 + 4 * 2 + 40)
    # A logit at position 3: layer 2's skip at position 3 alone, then as the feature at layer 2, the unembedding.
    assert tight_row_products(CFG, TCS, None, 3, SOURCES, position_zero=False) == (
        16 + layer_2 + layer_1 + layer_0 + zero + 20)
    # A feature at layer 0, position 2: the output projection, then per head and position a dot with a value.
    assert tight_row_products(CFG, TCS, 0, 2, SOURCES, position_zero=False) == 16 + 2 * 2 * 2 + 2 * 2 + 40
    # One position carried at layer 1: the value projection (8) is cheaper than the heads' vectors (16).
    assert tight_row_products(CFG, TCS, 1, 1, SOURCES, position_zero=False) == (
        16 + 8 + 16 + 16 + 2 + 2 * 2 + 2 + 40)


def test_the_tight_count_is_never_above_the_floor():
    for layer in (None, 0, 1, 2):
        for position in range(1, 12):
            assert tight_row_products(CFG, TCS, layer, position, SOURCES, False) <= row_products(
                CFG, TCS, layer, position + 1, SOURCES)
