"""alpha-er's reference checkpoint <-> the transformers one: round trips byte for byte, the embedded model
written both ways, HookedAlphaEr from either and from an in-memory AlphaErForCausalLM, and what is refused."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hooked_models import HookedAlphaEr, HookedArcee
from hooked_models.alpha_er_transformers import AlphaErForCausalLM
from hooked_models.embedded import embedded_checkpoint
from weight_conversion.alpha_er_transformers import (
    NAME_PAIRS,
    reference_config_fields,
    reference_name_of,
    reference_to_transformers_state_dict,
    transformers_config,
    transformers_tensor_name,
    transformers_to_reference_state_dict,
)
from weight_conversion.checkpoint import CheckpointError

FIELDS = ("vocab_size", "block_size", "n_layer", "n_embd", "n_head", "ffn_dim", "mlp_experts", "lm_head_rank",
          "attn_rank", "attn_soft_cap", "layer_norm_eps")


@pytest.fixture
def reference(reference_alpha_er_factory):
    return reference_alpha_er_factory(5, attn_soft_cap=6.0, layer_norm_eps=1e-4)


@pytest.fixture
def tokens():
    return torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(3))


def file_tensors(path) -> dict[str, tuple[torch.dtype, bytes]]:
    """Each tensor of a safetensors file as (dtype, its bytes)."""
    with safe_open(str(path), framework="pt") as f:
        return {name: (f.get_tensor(name).dtype, f.get_tensor(name).numpy().tobytes()) for name in f.keys()}


def test_names_map_one_to_one_both_ways(reference):
    names = list(reference.state_dict())
    ours = [transformers_tensor_name(n) for n in names]
    assert sorted(ours) == sorted(AlphaErForCausalLM(transformers_config(vars(reference.cfg))).state_dict())
    assert [reference_name_of(n) for n in ours] == names
    assert len({ref for ref, _ in NAME_PAIRS}) == len({tf for _, tf in NAME_PAIRS}) == len(NAME_PAIRS)


def test_config_round_trips(reference):
    config = transformers_config({name: json.dumps(getattr(reference.cfg, name)) for name in FIELDS})  # a header
    assert (config.hidden_size, config.num_hidden_layers, config.max_position_embeddings, config.attn_soft_cap,
            config.layer_norm_eps) == (24, 2, 32, 6.0, 1e-4)
    assert config.n_embd == 24 and config.block_size == 32   # the reference's names, read-only
    assert reference_config_fields(config) == {"model_type": "alpha-er", **{n: getattr(reference.cfg, n)
                                                                              for n in FIELDS}}


def test_reference_to_transformers_to_reference_is_byte_identical(reference, tokens, tmp_path):
    """The reference's file -> HookedAlphaEr -> transformers directory -> HookedAlphaEr -> the reference's file."""
    source = tmp_path / "reference.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(source),
              metadata={name: json.dumps(getattr(reference.cfg, name)) for name in FIELDS})
    HookedAlphaEr.from_pretrained(source).save_pretrained(tmp_path / "hf", format="transformers")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(hf(tokens).logits, reference(tokens))
    back = HookedAlphaEr.from_pretrained(tmp_path / "hf")
    back.save_pretrained(tmp_path / "back.safetensors")
    assert file_tensors(tmp_path / "back.safetensors") == file_tensors(source)
    # The transformers file holds the same bytes under its own names.
    written = file_tensors(tmp_path / "hf" / "model.safetensors")
    assert {reference_name_of(name): value for name, value in written.items()} == file_tensors(source)


def test_state_dicts_round_trip_as_the_same_tensors(reference):
    state = reference.state_dict()
    there = reference_to_transformers_state_dict(state)
    back = transformers_to_reference_state_dict(there)
    assert list(back) == list(state) and all(back[n] is state[n] for n in state)


def test_the_embedded_alpha_er_is_written_both_ways(tmp_path):
    embedded = HookedAlphaEr.from_pretrained("embedded")
    tokens = embedded.to_tokens(["When Mary and John went to the store, John gave a drink to"])
    tokens = torch.cat([tokens, tokens.new_zeros(1, embedded.cfg.block_size - tokens.shape[1])], dim=1)
    embedded.save_pretrained(tmp_path / "hf", format="transformers")
    assert {"configuration_alpha_er.py", "modeling_alpha_er.py", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(hf(tokens).logits, embedded(tokens))
    again = HookedAlphaEr.from_pretrained(tmp_path / "hf")
    assert again.tokenizer is not None and again.to_tokens(" John").tolist() == embedded.to_tokens(" John").tolist()
    again.save_pretrained(tmp_path / "reference.safetensors")
    shipped = embedded_checkpoint("alpha_er") / "model.safetensors"
    assert file_tensors(tmp_path / "reference.safetensors") == file_tensors(shipped)


def test_from_hf_and_to_hf(reference, tokens):
    hf = AlphaErForCausalLM(transformers_config(vars(reference.cfg)))
    hf.load_state_dict(reference_to_transformers_state_dict(reference.state_dict()))
    model = HookedAlphaEr.from_hf(hf.eval())
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))
        shared = model.to_hf()
        assert shared.model.layers[1].mlp.up_proj.data_ptr() == model.layers[1].mlp.up_proj.weight.data_ptr()
        assert torch.equal(shared(tokens).logits, reference(tokens))


def test_an_unknown_tensor_is_refused(reference):
    state = {**reference.state_dict(), "blocks.0.fc3s": torch.zeros(1)}
    with pytest.raises(CheckpointError, match="unexpected tensor 'blocks.0.fc3s'"):
        reference_to_transformers_state_dict(state)
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.rotary_emb.inv_freq'"):
        transformers_to_reference_state_dict({"model.rotary_emb.inv_freq": torch.zeros(1)})


def test_an_unknown_field_in_a_transformers_checkpoint_is_refused(reference, tmp_path):
    HookedAlphaEr.from_reference(reference).save_pretrained(tmp_path, format="transformers")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": 1e4}))
    unknown = r"config.json: AlphaErConfig does not know the field\(s\) \['rope_theta'\]"
    with pytest.raises(CheckpointError, match=unknown):
        HookedAlphaEr.from_pretrained(tmp_path)


def test_a_checkpoint_of_the_other_family_is_refused(tiny_hf_arcee, reference, tmp_path):
    tiny_hf_arcee.save_pretrained(tmp_path / "arcee")
    with pytest.raises(CheckpointError, match="model_type is 'arcee'; HookedAlphaEr loads model_type 'alpha-er'"):
        HookedAlphaEr.from_pretrained(tmp_path / "arcee")
    with pytest.raises(CheckpointError, match="ArceeForCausalLM is not an AlphaErForCausalLM"):
        HookedAlphaEr.from_hf(tiny_hf_arcee)
    HookedAlphaEr.from_reference(reference).save_pretrained(tmp_path / "alpha", format="transformers")
    with pytest.raises(CheckpointError, match="model_type is 'alpha-er'; HookedArcee loads model_type 'arcee'"):
        HookedArcee.from_pretrained(tmp_path / "alpha")


def test_save_format_is_checked(reference, tmp_path):
    model = HookedAlphaEr.from_reference(reference)
    with pytest.raises(ValueError, match="format='gguf' must be 'reference' or 'transformers'"):
        model.save_pretrained(tmp_path, format="gguf")
    with pytest.raises(CheckpointError, match="a transformers checkpoint is a directory"):
        model.save_pretrained(tmp_path / "x.safetensors", format="transformers")
