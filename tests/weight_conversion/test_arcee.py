"""The Arcee converter and loader on real checkpoint directories written by transformers."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hooked_models import HookedArcee
from weight_conversion.arcee import convert_arcee_config, convert_arcee_state_dict
from weight_conversion.checkpoint import CheckpointError

# AFM-4.5B's own config.json, in the older rope_scaling spelling it ships with.
AFM_4_5B_CONFIG = {
    "architectures": ["ArceeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128003, "head_dim": 128, "hidden_act": "relu2", "hidden_size": 2560,
    "initializer_range": 0.02, "intermediate_size": 18432, "max_position_embeddings": 65536, "mlp_bias": False,
    "model_type": "arcee", "num_attention_heads": 20, "num_hidden_layers": 36, "num_key_value_heads": 4,
    "pad_token_id": 128004, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 20.0, "mscale": 1.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn", "type": "yarn"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.53.0",
    "use_cache": True, "vocab_size": 128005,
}


def test_afm_config_converts():
    cfg = convert_arcee_config(AFM_4_5B_CONFIG)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (36, 2560, 20, 4, 128, 18432, 128005)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 20.0
    assert cfg.rope.original_max_position_embeddings == 4096 and cfg.dtype == torch.bfloat16


def test_yarn_explicit_factor_wins_as_in_transformers():
    """AFM-4.5B: factor 20 against 65536/4096 = 16. transformers uses 20, and so must we."""
    from transformers import ArceeConfig
    from transformers.models.arcee.modeling_arcee import ArceeRotaryEmbedding

    from hooked_models.components.rotary import RotaryEmbedding

    hf_config = ArceeConfig(**{k: v for k, v in AFM_4_5B_CONFIG.items() if k not in ("torch_dtype",)})
    hf_rotary = ArceeRotaryEmbedding(hf_config)
    cfg = convert_arcee_config(AFM_4_5B_CONFIG)
    ours = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    assert torch.equal(ours.inv_freq(torch.device("cpu")), hf_rotary.inv_freq)
    assert ours.attention_scaling == hf_rotary.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(20.0)).item() + 1)
    positions = torch.tensor([[0, 1, 4095, 4096, 20000, 65535]])
    x = torch.zeros(1, 6, 128)
    for a, b in zip(ours(positions, torch.float32), hf_rotary(x, positions)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("vocab_size", [128004, 128005, 128064, 128256])
def test_every_afm_vocab_size_loads(tmp_path, hf_arcee_factory, vocab_size):
    hf = hf_arcee_factory(seed=5, vocab_size=vocab_size, hidden_size=8, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=4, intermediate_size=8, num_hidden_layers=1,
                          bos_token_id=128000, eos_token_id=128001, pad_token_id=None)
    hf.save_pretrained(tmp_path)
    model = HookedArcee.from_pretrained(tmp_path)
    assert model.cfg.vocab_size == vocab_size and model.lm_head.weight.shape == (vocab_size, 8)
    ids = torch.tensor([[128000, 5, vocab_size - 1]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_pre_anneal_plain_rotary(tmp_path, hf_arcee_factory):
    hf = hf_arcee_factory(seed=6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          max_position_embeddings=64)
    hf.save_pretrained(tmp_path)
    model = HookedArcee.from_pretrained(tmp_path)
    assert model.cfg.rope.rope_type == "default" and model.rotary_emb.attention_scaling == 1.0
    ids = torch.randint(0, 97, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_state_dict_converter_is_pure_and_complete(tiny_hf_arcee):
    from weight_conversion.arcee import convert_arcee_config

    cfg = convert_arcee_config(tiny_hf_arcee.config.to_dict())
    source = tiny_hf_arcee.state_dict()
    converted = convert_arcee_state_dict(source, cfg)
    model = HookedArcee(cfg)
    model.load_state_dict(converted, strict=True)
    assert len(converted) == len(source)
    assert all(converted[k] is source["model." + k if k != "lm_head.weight" else k] for k in converted)


def test_tokenizer_is_loaded_when_present(tmp_path, tiny_hf_arcee):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2, "Paris": 3, "is": 4, "in": 5, "France": 6}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|begin_of_text|>",
                                        eos_token="<|end_of_text|>", pad_token="<pad>")
    tiny_hf_arcee.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = HookedArcee.from_pretrained(tmp_path)
    assert model.tokenizer is not None
    assert model.to_tokens("Paris is in France").tolist() == [[1, 3, 4, 5, 6]]
    with torch.no_grad():
        torch.testing.assert_close(model("Paris is in France"), model(torch.tensor([[1, 3, 4, 5, 6]])))


def test_no_tokenizer_says_so(tiny_arcee):
    with pytest.raises(ValueError, match="no tokenizer"):
        tiny_arcee("Paris")


def test_hub_id_from_the_local_cache_offline(tmp_path, monkeypatch, tiny_hf_arcee):
    import huggingface_hub.constants as constants

    snapshot = tmp_path / "hub" / "models--arcee-ai--AFM-tiny" / "snapshots" / ("0" * 40)
    tiny_hf_arcee.save_pretrained(snapshot)
    refs = tmp_path / "hub" / "models--arcee-ai--AFM-tiny" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = HookedArcee.from_pretrained("arcee-ai/AFM-tiny")
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), tiny_hf_arcee(ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(CheckpointError, match="neither a directory nor a Hub id"):
        HookedArcee.from_pretrained("arcee-ai/not-cached")


def test_weights_only_pickle_checkpoint(tmp_path, tiny_hf_arcee):
    tiny_hf_arcee.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    model = HookedArcee.from_pretrained(tmp_path)
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), tiny_hf_arcee(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.fixture
def checkpoint(tmp_path, tiny_hf_arcee):
    tiny_hf_arcee.save_pretrained(tmp_path)
    return tmp_path


def rewrite_tensors(path, change):
    state = load_file(path / "model.safetensors")
    change(state)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def rewrite_config(path, change):
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_tensor_is_named(checkpoint):
    rewrite_tensors(checkpoint, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: layers\.1\.mlp\.up_proj\.weight"):
        HookedArcee.from_pretrained(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
    rewrite_tensors(checkpoint, lambda s: s.__setitem__("model.layers.0.mlp.gate_proj.weight", torch.zeros(56, 40)))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.mlp\.gate_proj"):
        HookedArcee.from_pretrained(checkpoint)


def test_misshapen_tensor_is_named(checkpoint):
    rewrite_tensors(checkpoint, lambda s: s.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(60, 40)))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \(60, 40\).*\(12, 40\)"):
        HookedArcee.from_pretrained(checkpoint)


def test_wrong_model_type(checkpoint):
    rewrite_config(checkpoint, lambda c: c.__setitem__("model_type", "llama"))
    with pytest.raises(CheckpointError, match="model_type is 'llama'"):
        HookedArcee.from_pretrained(checkpoint)


def test_unknown_config_field(checkpoint):
    rewrite_config(checkpoint, lambda c: c.__setitem__("sliding_window", 128))
    with pytest.raises(CheckpointError, match="sliding_window.*not understood"):
        HookedArcee.from_pretrained(checkpoint)


def test_unsupported_rope_type(checkpoint):
    rewrite_config(checkpoint, lambda c: c.__setitem__("rope_parameters", {"rope_type": "llama3", "rope_theta": 1.0}))
    with pytest.raises(CheckpointError, match="rope_type 'llama3' is not supported"):
        HookedArcee.from_pretrained(checkpoint)


def test_load_builds_on_meta_and_allocates_once(checkpoint, monkeypatch):
    """The model is built on the meta device: no parameter is allocated before its tensor is read."""
    import hooked_models.families.arcee as arcee

    built = {}
    original = arcee._build_on_meta

    def spy(cfg):
        model = original(cfg)
        built["meta"] = all(p.is_meta for p in model.parameters())
        return model

    monkeypatch.setattr(arcee, "_build_on_meta", spy)
    HookedArcee.from_pretrained(checkpoint)
    assert built["meta"]
