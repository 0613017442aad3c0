"""alpha-er checkpoints: the reference's format both ways, and clear errors for what cannot load."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hooked_models import HookedAlphaEr
from weight_conversion.alpha_er import (
    NAME_PAIRS,
    convert_alpha_er_config,
    convert_alpha_er_name,
    reference_tensor_name,
)
from weight_conversion.checkpoint import CheckpointError

FIELDS = ("vocab_size", "block_size", "n_layer", "n_embd", "n_head", "ffn_dim", "mlp_experts", "lm_head_rank",
          "attn_rank", "attn_soft_cap", "layer_norm_eps")


@pytest.fixture
def reference(reference_alpha_er_factory):
    return reference_alpha_er_factory(3, attn_soft_cap=8.0)


@pytest.fixture
def tokens():
    return torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(1))


def write_reference_checkpoint(model, path, metadata: dict | None = None) -> None:
    """The reference's format as its trainer writes it: tensors by reference name, config in the header."""
    if metadata is None:
        metadata = {name: str(getattr(model.cfg, name)) for name in FIELDS}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path), metadata=metadata)


def load_with_reference(path, classes):
    """What a reference user does: the config from the header, the state dict loaded strictly."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        state = {name: f.get_tensor(name) for name in f.keys()}
    cfg = classes["config"](**{name: json.loads(meta[name]) for name in FIELDS})
    model = classes["model"](cfg)
    model.load_state_dict(state, strict=True)
    return model.eval()


def test_save_pretrained_is_loaded_by_the_reference(reference, tokens, tmp_path, reference_alpha_er_classes):
    model = HookedAlphaEr.from_reference(reference)
    for target in (tmp_path / "dir", tmp_path / "alpha.safetensors"):
        model.save_pretrained(target)
        file = target / "model.safetensors" if target.suffix != ".safetensors" else target
        loaded = load_with_reference(file, reference_alpha_er_classes)
        with torch.no_grad():
            torch.testing.assert_close(loaded(tokens), model(tokens), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(loaded(tokens), reference(tokens), rtol=0, atol=0)
    assert json.loads((tmp_path / "dir" / "config.json").read_text())["attn_soft_cap"] == 8.0


def test_from_pretrained_reads_a_reference_written_file(reference, tokens, tmp_path):
    write_reference_checkpoint(reference, tmp_path / "alpha.safetensors")
    model = HookedAlphaEr.from_pretrained(tmp_path / "alpha.safetensors")
    assert model.cfg.attn_soft_cap == 8.0 and not model.training
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-5, atol=1e-5)
    # The directory that holds it loads the same.
    again = HookedAlphaEr.from_pretrained(tmp_path)
    torch.testing.assert_close(again.lm_head.up, model.lm_head.up, rtol=0, atol=0)


def test_config_json_beside_the_file(reference, tokens, tmp_path):
    write_reference_checkpoint(reference, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="carries no config"):
        HookedAlphaEr.from_pretrained(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({name: getattr(reference.cfg, name) for name in FIELDS}))
    model = HookedAlphaEr.from_pretrained(tmp_path / "model.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-5, atol=1e-5)


def test_torch_state_dict_file(reference, tokens, tmp_path):
    torch.save(reference.state_dict(), tmp_path / "alpha.pt")
    (tmp_path / "config.json").write_text(json.dumps({name: getattr(reference.cfg, name) for name in FIELDS}))
    model = HookedAlphaEr.from_pretrained(tmp_path / "alpha.pt")
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-5, atol=1e-5)


def test_header_and_config_json_must_agree(reference, tmp_path):
    write_reference_checkpoint(reference, tmp_path / "model.safetensors")
    fields = {name: getattr(reference.cfg, name) for name in FIELDS}
    (tmp_path / "config.json").write_text(json.dumps({**fields, "attn_soft_cap": 30.0}))
    with pytest.raises(CheckpointError, match=r"disagree on \['attn_soft_cap'\]"):
        HookedAlphaEr.from_pretrained(tmp_path / "model.safetensors")


@pytest.mark.parametrize("damage, message", [
    (lambda s: s.pop("blocks.1.qkv.mid_b"), r"missing tensors: layers\.1\.self_attn\.qkv_proj\.norm\.bias"),
    (lambda s: s.update({"blocks.0.gate": torch.zeros(3)}), r"unexpected tensor 'blocks\.0\.gate'"),
    (lambda s: s.update({"blocks.2.fc1s": torch.zeros(3)}), r"unexpected tensor 'blocks\.2\.fc1s'"),
    (lambda s: s.update({"blocks.0.fc1s": torch.zeros(4, 12, 23)}),
     r"tensor 'blocks\.0\.fc1s' has shape \(4, 12, 23\), but the config makes 'layers\.0\.mlp\.up_proj\.weight' "
     r"\(4, 12, 24\)"),
])
def test_tensor_errors_name_the_tensor(reference, tmp_path, damage, message):
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    damage(state)
    metadata = {name: str(getattr(reference.cfg, name)) for name in FIELDS}
    save_file(state, str(tmp_path / "alpha.safetensors"), metadata=metadata)
    with pytest.raises(CheckpointError, match=message):
        HookedAlphaEr.from_pretrained(tmp_path / "alpha.safetensors")


@pytest.mark.parametrize("fields, message", [
    (dict(ffn_dim="50"), "ffn_dim=50 is not divisible by mlp_experts=4"),
    (dict(n_head="5"), "n_embd=24 is not divisible by n_head=5"),
    (dict(block_size="30"), "block_size=30 is not divisible by mlp_experts=4"),
    (dict(rope_theta="10000"), r"config field\(s\) \['rope_theta'\] are not understood"),
    (dict(n_layer="two"), "n_layer='two' is not a number"),
    (dict(n_layer="2.5"), "n_layer=2.5 is not an integer"),
    (dict(model_type="llama"), "model_type is 'llama'"),
])
def test_config_errors_name_the_fields(reference, tmp_path, fields, message):
    metadata = {**{name: str(getattr(reference.cfg, name)) for name in FIELDS}, **fields}
    write_reference_checkpoint(reference, tmp_path / "alpha.safetensors", metadata=metadata)
    with pytest.raises(CheckpointError, match=message):
        HookedAlphaEr.from_pretrained(tmp_path / "alpha.safetensors")


def test_names_map_both_ways(reference):
    model = HookedAlphaEr.from_reference(reference)
    hooked = {name for name, _ in model.named_parameters()}
    assert {convert_alpha_er_name(name) for name, _ in reference.named_parameters()} == hooked
    assert all(convert_alpha_er_name(reference_tensor_name(name)) == name for name in hooked)
    assert len(NAME_PAIRS) == 2 + 4 + 2 + 2 + 3 * 4
    with pytest.raises(KeyError):
        convert_alpha_er_name("blocks.0.attn.c_attn.weight")


def test_config_from_header_strings_and_defaults():
    cfg = convert_alpha_er_config({"n_layer": "3", "attn_soft_cap": "0", "layer_norm_eps": "1e-06", "format": "pt"})
    assert (cfg.n_layer, cfg.attn_soft_cap, cfg.layer_norm_eps, cfg.n_embd) == (3, 0.0, 1e-6, 1024)


def test_from_reference_needs_the_config(reference):
    del reference.cfg.attn_rank
    with pytest.raises(CheckpointError, match=r"cfg is missing field\(s\) \['attn_rank'\]"):
        HookedAlphaEr.from_reference(reference)


def test_a_saved_directory_loads_without_transformers_warning(tmp_path, capfd):
    """The directory's config.json is alpha-er's, not a transformers model's: loading its tokenizer must not
    make transformers read it (and warn "You are using a model of type alpha-er ...")."""
    model = HookedAlphaEr.from_pretrained("embedded")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "tokenizer.json").exists()
    capfd.readouterr()
    loaded = HookedAlphaEr.from_pretrained(tmp_path)
    out, err = capfd.readouterr()
    assert "model of type" not in out + err and err == "", err
    text = "When Mary and John went to the store together, John gave a drink to"
    assert torch.equal(loaded.to_tokens(text), model.to_tokens(text))
