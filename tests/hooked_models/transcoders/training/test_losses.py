"""The training objective against hand computations: FVU as sparsify defines it, AuxK on a planted dead
feature, the dead window in tokens, BatchTopK's k·B, Anthropic's tanh penalty and pre-activation loss, the
learning-rate schedule, and the config's one-line refusals. Transcoders here keep encoder and decoder untied."""

import pytest
import torch

from hooked_models.transcoders import ModelIdentity, TrainingConfig
from hooked_models.transcoders.training.distributed import Layout, process_group
from hooked_models.transcoders.training import objective
from hooked_models.transcoders.training.losses import activate, fvu, topk_code, total_variance
from hooked_models.transcoders.training.objective import SPARSE_DECODE_RATIO, after_step, batch_loss
from hooked_models.transcoders.training.state import Shard
from hooked_models.transcoders.training.trainer import lr_factor

IDENTITY = ModelIdentity("arcee", 8, 1)


@pytest.fixture
def group():
    with process_group(), torch.enable_grad():
        yield


def untied_shard(config: TrainingConfig, seed: int = 0) -> Shard:
    """A one-layer shard with every parameter drawn on its own (no encoder is its decoder's transpose)."""
    shard = Shard(IDENTITY, config, Layout("data", config.d_transcoder))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in shard.module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        if shard.threshold(0) is not None:
            shard.threshold(0).copy_(torch.rand(config.d_transcoder, generator=g) * 0.5)
    return shard


def batch(seed=1, tokens=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, tokens, 8, generator=g), torch.randn(1, tokens, 8, generator=g) + 0.7


def test_fvu_is_sparsifys_definition(group):
    _, y = batch()
    y_hat = y + 0.3 * torch.randn_like(y)
    expected = (y[0] - y_hat[0]).pow(2).sum() / (y[0] - y[0].mean(0)).pow(2).sum()  # sparsify's SparseCoder
    measured = fvu(y[0] - y_hat[0], total_variance(y[0], Layout("data", 8)))
    torch.testing.assert_close(measured, expected, rtol=1e-6, atol=0)


def test_a_wide_topk_decoded_sparsely_equals_the_dense_hand_computation(group, monkeypatch):
    """Where the width is at least SPARSE_DECODE_RATIO·k, TopK's rows are decoded as k decoder rows each: the
    loss and every gradient equal the dense computation by hand (relu of each row's k largest, times W_dec;
    some rows' kept pre-activations negative)."""
    config = TrainingConfig(d_transcoder=64, activation="topk", k=2, auxk_alpha=0.0)
    assert config.d_transcoder >= SPARSE_DECODE_RATIO * config.k
    shard = untied_shard(config)
    with torch.no_grad():
        shard.b_enc(0).sub_(4.0)
    x, y = batch()
    codes = []
    monkeypatch.setattr(objective, "topk_code", lambda *a: codes.append(topk_code(*a)) or codes[-1])
    result = batch_loss(shard, x, y, config, Layout("data", 64), tokens=32)
    assert len(codes) == 1 and bool((codes[0].values == 0).any())  # decoded sparsely; some kept values cut
    result.loss.backward()
    W_enc, b_enc, W_dec, b_dec = (p.detach().clone().requires_grad_() for p in
                                  (shard.enc(0), shard.b_enc(0), shard.dec(0, 0), shard.b_dec(0)))
    pre = x[0] @ W_enc + b_enc
    kth = pre.detach().sort(-1, descending=True).values[:, 1:2]
    acts = torch.relu(pre) * (pre >= kth)
    expected = ((y[0] - acts @ W_dec - b_dec) ** 2).sum() / ((y[0] - y[0].mean(0)) ** 2).sum()
    expected.backward()
    torch.testing.assert_close(result.loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(result.acts[0], acts.detach(), rtol=0, atol=0)
    for mine, theirs in zip((shard.enc(0), shard.b_enc(0), shard.dec(0, 0), shard.b_dec(0)),
                            (W_enc, b_enc, W_dec, b_dec)):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)


def top2_error(shard: Shard, x, y) -> tuple:
    """By hand: the pre-activations of a one-layer TopK (k=2) shard and the error its live features leave."""
    pre = x[0] @ shard.enc(0) + shard.b_enc(0)
    live = torch.zeros_like(pre)
    top = pre.topk(2, dim=-1)
    live.scatter_(-1, top.indices, torch.relu(top.values))
    return pre, y[0] - (live @ shard.dec(0, 0) + shard.b_dec(0))


def test_auxk_gives_a_planted_dead_feature_a_gradient(group):
    config = TrainingConfig(d_transcoder=8, activation="topk", k=2, auxk_alpha=0.5, dead_tokens=100)
    shard = untied_shard(config)
    with torch.no_grad():  # features 0 and 1 win every token; feature 5 is positive but never in the top 2
        shard.b_enc(0).copy_(torch.tensor([20.0, 20, -30, -30, -30, 3, -30, -30]))
        shard.enc(0)[:, 5].mul_(0.1)
    shard.since_fired[0][5] = 100  # dead: no firing for dead_tokens tokens
    x, y = batch()
    result = batch_loss(shard, x, y, config, shard.layout, 32)
    result.loss.backward()
    assert float(shard.enc(0).grad[:, 5].abs().sum()) > 0 and float(shard.dec(0, 0).grad[5].abs().sum()) > 0
    # The AuxK loss by hand: k_aux = min(d // 2, dead) = 1, scale min(dead / (d // 2), 1) = 1/4.
    with torch.no_grad():
        pre, error = top2_error(shard, x, y)
        e_hat = torch.relu(pre[:, 5:6]) @ shard.dec(0, 0)[5:6]
        expected = 0.25 * (e_hat - error).pow(2).sum() / (y[0] - y[0].mean(0)).pow(2).sum()
    torch.testing.assert_close(result.auxk, expected, rtol=1e-5, atol=0)
    # Without AuxK the dead feature gets nothing.
    off = untied_shard(config.replace(auxk_alpha=0.0))
    with torch.no_grad():
        off.b_enc(0).copy_(shard.b_enc(0))
        off.enc(0).copy_(shard.enc(0))
    off.since_fired[0][5] = 100
    batch_loss(off, x, y, off.config, off.layout, 32).loss.backward()
    assert float(off.enc(0).grad[:, 5].abs().sum()) == 0


def test_auxk_takes_each_tokens_k_aux_largest_dead_features(group):
    """Six dead features, more than k_aux = d // 2 = 4: each token's 4 largest dead pre-activations (through
    ReLU) reconstruct the error, the loss at full scale; the live features take no part."""
    config = TrainingConfig(d_transcoder=8, activation="topk", k=2, auxk_alpha=0.5, dead_tokens=100)
    shard = untied_shard(config, seed=4)
    dead = torch.tensor([True, False, True, True, False, True, True, True])
    shard.since_fired[0][dead] = 100
    x, y = batch(seed=5)
    result = batch_loss(shard, x, y, config, shard.layout, 32)
    with torch.no_grad():
        pre, error = top2_error(shard, x, y)
        dead_pre = torch.where(dead, pre, torch.full_like(pre, -torch.inf))
        chosen = torch.zeros_like(pre).scatter_(-1, dead_pre.topk(4, dim=-1).indices, 1) * torch.relu(pre)
        assert int(((chosen > 0) & ~dead).sum()) == 0 and int((chosen > 0).sum()) > 32  # dead ones, most positive
        expected = (chosen @ shard.dec(0, 0) - error).pow(2).sum() / (y[0] - y[0].mean(0)).pow(2).sum()
    torch.testing.assert_close(result.auxk, expected, rtol=1e-5, atol=0)


def test_the_dead_window_counts_tokens_not_steps(group):
    """dead_tokens=300: a feature that never fires is alive after 4 batches of 64 tokens (256) and dead
    after 5 (320); with batches of 128 tokens, dead after 3 (384) though fewer steps."""
    for tokens, alive_steps in ((64, 4), (128, 2)):
        config = TrainingConfig(d_transcoder=8, activation="topk", k=2, dead_tokens=300)
        shard = untied_shard(config)
        x, y = batch(tokens=tokens)
        for step in range(alive_steps + 1):
            result = batch_loss(shard, x, y, config, shard.layout, tokens)
            result.acts[0][:, 7] = 0  # feature 7 never fires
            after_step(shard, result, config, shard.layout, tokens, step)
            assert bool(shard.since_fired[0][7] >= 300) == (step == alive_steps)
        assert int(shard.since_fired[0][7]) == tokens * (alive_steps + 1)
        fired = result.acts[0].gt(0).any(0)
        assert fired.any() and int(shard.since_fired[0][fired].max()) == 0


def test_batchtopk_keeps_exactly_k_times_b_activations(group):
    g = torch.Generator().manual_seed(2)
    pre = torch.randn(32, 64, generator=g) + 1.0
    acts, kept = activate("batchtopk", pre, Layout("data", 64), k=4, batch_tokens=32)
    assert int((acts > 0).sum()) == 4 * 32
    largest = pre.flatten().topk(4 * 32).values
    assert torch.equal(acts[acts > 0].sort().values, largest.sort().values)
    assert float(kept) == float(largest.min())
    per_token = (acts > 0).sum(-1)
    assert int(per_token.min()) != int(per_token.max())  # k on average, not per token


def test_the_tanh_penalty_and_pre_activation_loss_equal_a_hand_computation(group):
    config = TrainingConfig(d_transcoder=8, activation="jumprelu", sparsity=0.3, tanh_scale=4.0, pre_act_loss=0.2,
                            bandwidth=0.05)
    shard = untied_shard(config, seed=4)
    with torch.no_grad():
        shard.b_enc(0)[3] = -6.0  # feature 3 below its threshold on every token: dead but for the pre-act loss
    x, y = batch(seed=5)
    result = batch_loss(shard, x, y, config, shard.layout, 32)
    with torch.no_grad():
        w_enc, b_enc, w_dec, b_dec, theta = (t.detach().double() for t in (
            shard.enc(0), shard.b_enc(0), shard.dec(0, 0), shard.b_dec(0), shard.threshold(0)))
        x64, y64 = x[0].double(), y[0].double()
        pre = x64 @ w_enc + b_enc
        f = pre * (pre > theta)
        norms = w_dec.norm(dim=-1)
        reconstruction = ((y64 - f @ w_dec - b_dec) ** 2).sum() / ((y64 - y64.mean(0)) ** 2).sum()
        tanh = sum(torch.tanh(4.0 * f[t].abs() * norms).sum() for t in range(32)) / 32
        pre_act = sum((torch.relu(theta - pre[t]) * norms).sum() for t in range(32)) / 32
        expected = reconstruction + 0.3 * tanh + 0.2 * pre_act
    assert float(tanh) > 0 and float(pre_act) > 0
    torch.testing.assert_close(result.loss.double(), expected, rtol=1e-5, atol=0)
    # The pre-activation term reaches features below their thresholds: their encoder columns get a gradient.
    result.loss.backward()
    below = (pre < theta).all(0)
    assert below.tolist() == [False, False, False, True, False, False, False, False]
    assert float(shard.enc(0).grad[:, 3].abs().min()) > 0


def test_the_learning_rate_warms_up_then_decays_to_zero():
    config = TrainingConfig(steps=100, warmup_steps=10, decay_fraction=0.2)
    factors = [lr_factor(s, config) for s in range(100)]
    assert factors[0] == 0.1 and factors[9] == 1.0 and factors[79] == 1.0
    assert factors[80] == 1.0 and factors[90] == 0.5 and factors[99] == pytest.approx(0.05)


@pytest.mark.parametrize("steps, warmup", [(1500, 150), (25_000, 1000), (9, 0)])
def test_the_default_warm_up_is_a_tenth_of_the_steps_at_most_a_thousand(steps, warmup):
    config = TrainingConfig(steps=steps)
    assert config.warmup_steps is None and config.warmup == warmup
    factors = [lr_factor(s, config) for s in range(min(steps, 2000))]
    if warmup:
        assert factors[0] == 1 / warmup and factors[warmup - 2] < 1.0 and factors[warmup - 1] == 1.0
    else:
        assert factors[0] == 1.0
    assert TrainingConfig(steps=steps, warmup_steps=0).warmup == 0 and lr_factor(0, config.replace(warmup_steps=0)) == 1.0


@pytest.mark.parametrize("changes, message", [
    (dict(activation="topk", k=300), r"k=300: topk needs an integer k in \[1, d_transcoder=256\]"),
    (dict(activation="batchtopk"), r"k=None: batchtopk needs an integer k"),
    (dict(activation="relu", k=4), r"k=4 is for activation='topk' or 'batchtopk', not 'relu'"),
    (dict(activation="gelu"), r"activation='gelu' must be one of relu, topk, batchtopk, jumprelu"),
    (dict(layout="model"), r"layout='model' must be one of data, features"),
    (dict(init="xavier"), r"init='xavier' must be one of tied, zero_decoder, unit_decoder"),
    (dict(init_spread="wide"), r"init_spread='wide' must be one of equal, drawn"),
    (dict(dead_tokens=0), r"dead_tokens=0 must be a positive integer"),
    (dict(lr=0.0), r"lr=0.0 must be a positive number"),
    (dict(warmup_steps=-1), r"warmup_steps=-1 must be a non-negative integer"),
    (dict(decay_fraction=1.5), r"decay_fraction=1.5 must be at most 1"),
    (dict(layers=(1, 1)), r"layers=\(1, 1\) must be distinct non-negative layer indices"),
    (dict(layers=(0,), cross_layer=True), r"layers=\(0,\): a cross-layer transcoder spans every layer"),
])
def test_bad_configs_are_one_line_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainingConfig(**changes)
    with pytest.raises(ValueError, match="TrainingConfig has no field 'widht'"):
        TrainingConfig().replace(widht=3)


def test_a_width_the_processes_do_not_divide_is_refused(monkeypatch, group):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda *a: 3)
    with pytest.raises(ValueError, match="d_transcoder=256 is not divisible by the 3 processes that shard"):
        Layout("features", 256)
