"""Layers spread over devices as TransformerLens's n_devices spreads them.

CPU-only machines check the placement rule against TransformerLens's own function, the assignment
of every parameter (with "meta" standing in for a second device), and a forward whose residual
crosses placement boundaries (all on the CPU). The real multi-GPU forward runs where 2 GPUs are.
"""

from types import SimpleNamespace

import pytest
import torch
from transformer_lens.utilities.multi_gpu import get_device_for_block_index

from hooked_models import HookedArcee
from hooked_models.devices import cuda_devices, layer_device, parameter_placement, spread_layers


@pytest.mark.parametrize("num_layers,n_devices", [(36, 4), (62, 8), (5, 2), (3, 4), (8, 1), (7, 3)])
def test_layer_groups_follow_transformer_lens(num_layers, n_devices):
    cfg = SimpleNamespace(device="cuda:0", n_layers=num_layers, n_devices=n_devices)
    devices = [torch.device("cuda", i) for i in range(n_devices)]
    ours = [layer_device(i, num_layers, devices) for i in range(num_layers)]
    assert ours == [get_device_for_block_index(i, cfg) for i in range(num_layers)]
    assert ours == sorted(ours, key=lambda d: d.index)  # contiguous groups


def test_every_parameter_goes_to_its_device(hf_arcee_factory):
    model = HookedArcee.from_hf(hf_arcee_factory(seed=0, num_hidden_layers=4))
    spread_layers(model, ["cpu", "meta"])  # "meta" stands in for a second device
    place = parameter_placement(4, ["cpu", "meta"])
    for name, p in model.named_parameters():
        assert p.device == place(name), name
    assert {p.device.type for p in model.layers[1].parameters()} == {"cpu"}
    assert {p.device.type for p in model.layers[2].parameters()} == {"meta"}
    assert model.embed_tokens.weight.device.type == "cpu"
    assert model.norm.weight.device.type == model.lm_head.weight.device.type == "meta"


def test_tied_head_stays_tied_on_the_embedding_device(hf_arcee_factory):
    model = HookedArcee.from_hf(hf_arcee_factory(seed=0, num_hidden_layers=4, tie_word_embeddings=True))
    spread_layers(model, ["cpu", "meta"])
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "cpu"


def test_forward_across_placements_is_unchanged(tiny_hf_arcee):
    model = HookedArcee.from_hf(tiny_hf_arcee)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask)
        expected_cached, expected_cache = model.run_with_cache(ids, attention_mask=mask)
        spread_layers(model, ["cpu", "cpu", "cpu"])
        assert len(model._device_hooks) > 1  # the pre-hooks that carry the residual are in place
        actual = model(ids, attention_mask=mask)
        actual_cached, cache = model.run_with_cache(ids, attention_mask=mask)
    assert torch.equal(actual, expected) and torch.equal(actual_cached, expected_cached)
    assert torch.equal(cache["blocks.1.hook_resid_pre"], expected_cache["blocks.1.hook_resid_pre"])


def test_n_devices_errors_name_the_limit():
    with pytest.raises(ValueError, match="n_devices must be a positive integer"):
        cuda_devices(0)
    with pytest.raises(ValueError, match="spreads layers over CUDA devices, but device is cpu"):
        cuda_devices(2, "cpu")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="CUDA device"):
            cuda_devices(64)


def test_from_pretrained_refuses_more_devices_than_visible(tmp_path, tiny_hf_arcee):
    tiny_hf_arcee.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="n_devices=64"):
        HookedArcee.from_pretrained(tmp_path, n_devices=64)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices to spread layers over")
def test_two_gpus_match_one(tmp_path, hf_arcee_factory):
    hf = hf_arcee_factory(seed=1, num_hidden_layers=4)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    one = HookedArcee.from_pretrained(tmp_path, device="cuda:0")
    two = HookedArcee.from_pretrained(tmp_path, n_devices=2)
    assert two.layers[3].mlp.up_proj.weight.device == torch.device("cuda", 1)
    assert two.embed_tokens.weight.device == torch.device("cuda", 0)
    with torch.no_grad():
        torch.testing.assert_close(two(ids).cpu(), one(ids).cpu())
    from_hf = HookedArcee.from_hf(hf, n_devices=2)
    assert from_hf.layers[0].self_attn.q_proj.weight.device == torch.device("cuda", 0)


# ------------------------------------------------------------------------- a device that is not there
UNAVAILABLE = [
    # (device, CUDA available, CUDA devices, MPS available, the error)
    ("cuda", False, 0, False, r"device 'cuda' needs CUDA, but this torch \(.*\) sees no CUDA device; available: cpu$"),
    ("cuda:3", True, 1, False, r"device 'cuda:3' does not exist: 1 CUDA device\(s\) are visible \(cuda:0 to cuda:0\); "
                               r"available: cpu, cuda:0$"),
    ("mps", True, 2, False, r"device 'mps' needs Apple's MPS, which this machine does not have; "
                            r"available: cpu, cuda:0, cuda:1$"),
    ("gpu", False, 0, False, r"device 'gpu' is not a device name \(.*\); available: cpu$"),
]


@pytest.mark.parametrize("device, cuda, count, mps, message", UNAVAILABLE, ids=[u[0] for u in UNAVAILABLE])
def test_an_unavailable_device_is_a_clear_error(monkeypatch, tiny_hf_arcee, reference_alpha_er_factory, device, cuda,
                                                count, mps, message):
    """On this CPU machine with torch's CUDA and MPS probes answering as given: every loader and `to`
    refuses the device with its name and the devices there are, before touching the weights."""
    from hooked_models import HookedAlphaEr

    model = HookedArcee.from_hf(tiny_hf_arcee)
    reference = reference_alpha_er_factory()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    for load in (lambda: HookedArcee.from_pretrained("embedded", device=device),
                 lambda: HookedArcee.from_hf(tiny_hf_arcee, device=device),
                 lambda: HookedAlphaEr.from_pretrained("embedded", device=device),
                 lambda: HookedAlphaEr.from_reference(reference, device=device),
                 lambda: model.to(device)):
        with pytest.raises(ValueError, match=message):
            load()
    assert model.cfg.device == torch.device("cpu") and model.embed_tokens.weight.device.type == "cpu"
