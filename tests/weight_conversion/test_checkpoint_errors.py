"""Checkpoints that cannot load say which file and which tensor or field, and nothing in one runs code.

Real checkpoint directories are written to tmp_path (transformers' save_pretrained of the tiny
oracle for Arcee, the reference's own format for alpha-er), then damaged the way files get damaged:
cut short, overwritten, edited by hand, or swapped for a pickle that carries a payload.
"""

import json
import pickle
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from hooked_models import HookedAlphaEr, HookedArcee
from weight_conversion.checkpoint import CheckpointError


class Payload:
    """Unpickling this calls open(marker, "w"): if the marker file exists, code ran from a checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def arcee_dir(tmp_path, tiny_hf_arcee):
    path = tmp_path / "arcee"
    tiny_hf_arcee.save_pretrained(path)
    return path


@pytest.fixture
def alpha_er_dir(tmp_path, reference_alpha_er_factory):
    """The reference's format: tensors by reference name, config fields as strings in the header."""
    reference = reference_alpha_er_factory(0)
    path = tmp_path / "alpha"
    path.mkdir()
    fields = {name: str(getattr(reference.cfg, name)) for name in (
        "vocab_size", "block_size", "n_layer", "n_embd", "n_head", "ffn_dim", "mlp_experts", "lm_head_rank",
        "attn_rank", "attn_soft_cap", "layer_norm_eps")}
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path / "model.safetensors"),
              metadata={"format": "pt", **fields})
    return path


LOADERS = {"arcee": HookedArcee.from_pretrained, "alpha-er": HookedAlphaEr.from_pretrained}


@pytest.fixture(params=["arcee", "alpha-er"])
def family(request, arcee_dir, alpha_er_dir):
    """(the family's loader, its checkpoint directory)."""
    return LOADERS[request.param], {"arcee": arcee_dir, "alpha-er": alpha_er_dir}[request.param]


def rewrite_tensors(path, change):
    file = path / "model.safetensors"
    state = load_file(file)
    change(state)
    save_file(state, str(file), metadata=_metadata(file))


def _metadata(file):
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.metadata()


def rewrite_config(path, change):
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


def test_the_undamaged_checkpoints_load(family):
    """The control: every damage below is what makes the load fail."""
    load, path = family
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load(path)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------------------------------- the bytes
def _cut(keep):
    def damage(file):
        data = file.read_bytes()
        file.write_bytes(data[: keep(len(data), int.from_bytes(data[:8], "little"))])
    return damage


def _overwrite(offset, data):
    def damage(file):
        raw = bytearray(file.read_bytes())
        raw[offset(len(raw)): offset(len(raw)) + len(data)] = data
        file.write_bytes(bytes(raw))
    return damage


CORRUPTIONS = {
    "cut in the tensor data": _cut(lambda size, header: size - 37),
    "cut in the header": _cut(lambda size, header: 8 + header // 2),
    "cut to the length prefix": _cut(lambda size, header: 5),
    "empty file": _cut(lambda size, header: 0),
    "header length past the end": _overwrite(lambda size: 0, (10**12).to_bytes(8, "little")),
    "header that is not JSON": _overwrite(lambda size: 8, b"\x00garbage{"),
    "random bytes": lambda file: file.write_bytes(bytes(range(256)) * 8),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_safetensors_file_is_named(family, corruption):
    load, path = family
    CORRUPTIONS[corruption](path / "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        load(path)
    assert "model.safetensors" in str(info.value)


# -------------------------------------------------------------------------------------- the tensors
TENSOR_DAMAGE = {
    # family: [(what, damage to the state dict, fragments the error must contain)]
    "arcee": [
        ("missing", lambda s: s.pop("model.norm.weight"), ["model.safetensors", "missing tensors: norm.weight"]),
        ("unexpected", lambda s: s.update({"model.layers.0.mlp.gate_proj.weight": torch.zeros(56, 40)}),
         ["model.safetensors", "unexpected tensor 'model.layers.0.mlp.gate_proj.weight'"]),
        ("past the last layer", lambda s: s.update({"model.layers.2.input_layernorm.weight": torch.ones(40)}),
         ["model.safetensors", "'model.layers.2.input_layernorm.weight'"]),
        ("mis-shaped", lambda s: s.update({"model.embed_tokens.weight": torch.zeros(96, 40)}),
         ["model.safetensors", "'model.embed_tokens.weight' has shape (96, 40)", "(97, 40)"]),
        ("transposed", lambda s: s.update({"model.layers.1.mlp.up_proj.weight": s["model.layers.1.mlp.up_proj.weight"].T.contiguous()}),
         ["model.safetensors", "'model.layers.1.mlp.up_proj.weight' has shape (40, 56)", "(56, 40)"]),
        ("integer", lambda s: s.update({"lm_head.weight": s["lm_head.weight"].to(torch.int8)}),
         ["model.safetensors", "'lm_head.weight' has dtype torch.int8"]),
    ],
    "alpha-er": [
        ("missing", lambda s: s.pop("ln_f.bias"), ["model.safetensors", "missing tensors: norm.bias"]),
        ("unexpected", lambda s: s.update({"blocks.0.gate": torch.zeros(3)}),
         ["model.safetensors", "unexpected tensor 'blocks.0.gate'"]),
        ("mis-shaped", lambda s: s.update({"wpe.weight": torch.zeros(31, 24)}),
         ["model.safetensors", "'wpe.weight' has shape (31, 24)", "(32, 24)"]),
        ("integer", lambda s: s.update({"blocks.1.fc2s": s["blocks.1.fc2s"].to(torch.int32)}),
         ["model.safetensors", "'blocks.1.fc2s' has dtype torch.int32"]),
    ],
}
TENSOR_CASES = [(fam, *case) for fam, cases in TENSOR_DAMAGE.items() for case in cases]


@pytest.mark.parametrize("fam, what, damage, fragments", TENSOR_CASES, ids=[f"{c[0]}-{c[1]}" for c in TENSOR_CASES])
def test_a_bad_tensor_is_named_with_its_file(fam, what, damage, fragments, arcee_dir, alpha_er_dir):
    path = {"arcee": arcee_dir, "alpha-er": alpha_er_dir}[fam]
    rewrite_tensors(path, damage)
    with pytest.raises(CheckpointError) as info:
        LOADERS[fam](path)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("fam, tensor", [("arcee", "model.layers.0.self_attn.o_proj.weight"),
                                         ("alpha-er", "blocks.0.proj.up")])
def test_non_finite_weights_are_warned_naming_file_and_tensor(fam, tensor, bad, arcee_dir, alpha_er_dir):
    path = {"arcee": arcee_dir, "alpha-er": alpha_er_dir}[fam]

    def poison(state):
        state[tensor] = state[tensor].clone()
        state[tensor][0, :2] = bad

    rewrite_tensors(path, poison)
    with pytest.warns(UserWarning, match=rf"model\.safetensors: tensor '{tensor}' has 2 NaN or inf values"):
        model = LOADERS[fam](path)
    # Loaded as it is (a warning, not a refusal): the values are what the file holds.
    assert int((~torch.isfinite(torch.cat([p.flatten() for p in model.parameters()]))).sum()) == 2


def test_a_tensor_in_two_shards_is_refused(arcee_dir):
    state = load_file(arcee_dir / "model.safetensors")
    (arcee_dir / "model.safetensors").unlink()
    names = sorted(state)
    first, second = names[: len(names) // 2], names[len(names) // 2 - 1:]  # one name in both
    save_file({n: state[n] for n in first}, str(arcee_dir / "model-00001-of-00002.safetensors"))
    save_file({n: state[n] for n in second}, str(arcee_dir / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in second})
    (arcee_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"model-00002-of-00002\.safetensors: tensor '{first[-1]}' appears "
                                              r"twice \(first in .*model-00001-of-00002\.safetensors\)"):
        HookedArcee.from_pretrained(arcee_dir)


def test_an_index_naming_a_missing_shard_is_refused(arcee_dir):
    (arcee_dir / "model.safetensors").rename(arcee_dir / "model-00001-of-00002.safetensors")
    weight_map = {"lm_head.weight": "model-00002-of-00002.safetensors",
                  "model.norm.weight": "model-00001-of-00002.safetensors"}
    (arcee_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json names shards that are missing: "
                                              r"\['model-00002-of-00002\.safetensors'\]"):
        HookedArcee.from_pretrained(arcee_dir)


def test_a_config_larger_than_the_weights_names_what_is_missing(arcee_dir):
    rewrite_config(arcee_dir, lambda c: c.update(num_hidden_layers=3))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\) is missing tensors: layers\.2\."):
        HookedArcee.from_pretrained(arcee_dir)


# ------------------------------------------------------------------------------------- the config
def _set(**fields):
    return lambda c: c.update(fields)


ARCEE_CONFIGS = [
    # (what, change to config.json, fragments the error must contain besides the file)
    ("model_type llama", _set(model_type="llama"), ["model_type is 'llama'", "'arcee' only"]),
    ("no model_type", lambda c: c.pop("model_type"), ["model_type is None"]),
    ("unknown field", _set(num_experts=8), ["['num_experts']", "not understood"]),
    ("sliding window", _set(sliding_window=64), ["['sliding_window']", "not understood"]),
    ("sliding layers", _set(layer_types=["full_attention", "sliding_attention"]), ["sliding_attention"]),
    ("missing field", lambda c: c.pop("hidden_size"), ["missing field(s) ['hidden_size']"]),
    ("gated activation", _set(hidden_act="silu"), ["hidden_act is 'silu'", "relu2"]),
    ("biases", _set(attention_bias=True), ["attention_bias is true"]),
    ("heads vs kv heads", _set(num_key_value_heads=3), ["num_heads=10 is not a multiple of num_kv_heads=3"]),
    ("odd head_dim", _set(head_dim=5), ["head_dim=5 must be even"]),
    ("negative size", _set(hidden_size=-40), ["hidden_size is -40", "positive integer"]),
    ("size as text", _set(intermediate_size="56"), ["intermediate_size is '56'", "positive integer"]),
    ("zero layers", _set(num_hidden_layers=0), ["num_hidden_layers is 0"]),
    ("fractional vocab", _set(vocab_size=96.5), ["vocab_size is 96.5"]),
    ("eps out of range", _set(rms_norm_eps=0), ["rms_norm_eps is 0"]),
    ("two rope thetas", _set(rope_theta=500000.0), ["rope_theta is 500000.0 at the top level but 10000.0"]),
    ("two rope spellings", _set(rope_scaling={"rope_type": "yarn", "factor": 8.0}),
     ["rope_parameters and rope_scaling disagree on ['factor']"]),
    ("rope not an object", _set(rope_parameters="yarn"), ["rope_parameters is 'yarn'"]),
    ("negative rope factor", lambda c: c["rope_parameters"].update(factor=-2.0), ["rope factor is -2.0"]),
    ("zero rope theta", lambda c: c["rope_parameters"].update(rope_theta=0), ["rope rope_theta is 0"]),
    ("unknown rope parameter", lambda c: c["rope_parameters"].update(low_freq_factor=1.0),
     ["['low_freq_factor']", "not understood"]),
    *((f"rope type {t}", _set(rope_parameters={"rope_type": t, "rope_theta": 10000.0, "factor": 2.0}),
       [f"rope_type '{t}' is not supported", "['default', 'yarn']"])
      for t in ("linear", "dynamic", "llama3", "longrope", "su")),
]


@pytest.mark.parametrize("what, change, fragments", ARCEE_CONFIGS, ids=[c[0] for c in ARCEE_CONFIGS])
def test_a_bad_arcee_config_is_named_with_its_file(arcee_dir, what, change, fragments):
    rewrite_config(arcee_dir, change)
    with pytest.raises(CheckpointError) as info:
        HookedArcee.from_pretrained(arcee_dir)
    message = str(info.value)
    assert str(arcee_dir / "config.json") in message
    for fragment in fragments:
        assert fragment in message, message


def test_the_older_rope_spelling_that_agrees_is_accepted(arcee_dir, tiny_hf_arcee):
    """AFM-4.5B ships rope_scaling (with both 'type' and 'rope_type') and a top-level rope_theta."""
    def older(config):
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = {**rope, "type": rope["rope_type"]}
    rewrite_config(arcee_dir, older)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(HookedArcee.from_pretrained(arcee_dir)(ids), tiny_hf_arcee(ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("text, fragment", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
    ("\xff\xfe", "is not valid JSON"),
])
def test_an_unreadable_arcee_config_is_named(arcee_dir, text, fragment):
    (arcee_dir / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(CheckpointError) as info:
        HookedArcee.from_pretrained(arcee_dir)
    assert "config.json" in str(info.value) and fragment in str(info.value)


def test_a_missing_arcee_config_is_named(arcee_dir):
    (arcee_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        HookedArcee.from_pretrained(arcee_dir)


@pytest.mark.parametrize("fields, fragment", [
    (dict(n_head="5"), "n_embd=24 is not divisible by n_head=5"),
    (dict(block_size="30"), "block_size=30 is not divisible by mlp_experts=4"),
    (dict(n_layer="-1"), "n_layer=-1 must be a positive integer"),
    (dict(model_type="arcee"), "model_type is 'arcee'"),
    (dict(rope_theta="10000"), "['rope_theta'] are not understood"),
])
def test_a_bad_alpha_er_header_is_named_with_its_file(alpha_er_dir, fields, fragment):
    file = alpha_er_dir / "model.safetensors"
    state, metadata = load_file(file), _metadata(file)
    save_file(state, str(file), metadata={**metadata, **fields})
    with pytest.raises(CheckpointError) as info:
        HookedAlphaEr.from_pretrained(file)
    assert "model.safetensors" in str(info.value) and fragment in str(info.value), str(info.value)


# ------------------------------------------------------------------------------------------ pickles
def _write_malicious_zip(file, marker):
    """torch.save's format, as a .bin a checkpoint would carry, with the payload among the tensors."""
    torch.save({"model.norm.weight": torch.ones(40), "trap": Payload(marker)}, file)


def _write_malicious_plain(file, marker):
    """An old-style plain pickle (no zip container), the payload at the top."""
    with open(file, "wb") as f:
        pickle.dump({"model.norm.weight": torch.ones(40), "trap": Payload(marker)}, f, protocol=2)


@pytest.mark.parametrize("write", [_write_malicious_zip, _write_malicious_plain], ids=["torch.save", "plain pickle"])
def test_a_pickle_with_a_payload_does_not_run_and_is_refused(arcee_dir, tmp_path, write):
    marker = tmp_path / "payload-ran"
    (arcee_dir / "model.safetensors").unlink()
    write(arcee_dir / "pytorch_model.bin", marker)
    with pytest.raises(CheckpointError) as info:
        HookedArcee.from_pretrained(arcee_dir)
    assert not marker.exists(), "code in the checkpoint ran"
    assert "pytorch_model.bin" in str(info.value) and "weights_only=True" in str(info.value)


def test_an_alpha_er_pickle_with_a_payload_does_not_run(alpha_er_dir, tmp_path):
    marker = tmp_path / "payload-ran"
    file = alpha_er_dir / "model.safetensors"
    fields = {k: json.loads(v) for k, v in _metadata(file).items() if k != "format"}
    (alpha_er_dir / "config.json").write_text(json.dumps(fields))
    state = load_file(file)
    file.unlink()
    torch.save({**state, "trap": Payload(marker)}, alpha_er_dir / "model.pt")
    with pytest.raises(CheckpointError, match=r"model\.pt cannot be loaded with torch\.load\(weights_only=True\)"):
        HookedAlphaEr.from_pretrained(alpha_er_dir)
    assert not marker.exists()
    # The control: the same file without the payload loads.
    torch.save(state, alpha_er_dir / "model.pt")
    HookedAlphaEr.from_pretrained(alpha_er_dir)


def test_the_payload_would_run_without_weights_only(tmp_path):
    """The control for the tests above: the payload is real, so its absence there means something."""
    marker = tmp_path / "payload-ran"
    _write_malicious_zip(tmp_path / "trap.bin", marker)
    torch.load(tmp_path / "trap.bin", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("plain", [False, True], ids=["torch.save", "plain pickle"])
def test_a_clean_pickle_loads_in_either_format(arcee_dir, tiny_hf_arcee, plain):
    state = load_file(arcee_dir / "model.safetensors")
    (arcee_dir / "model.safetensors").unlink()
    torch.save(state, arcee_dir / "pytorch_model.bin", _use_new_zipfile_serialization=not plain)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(HookedArcee.from_pretrained(arcee_dir)(ids), tiny_hf_arcee(ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("content, fragment", [
    ([torch.ones(3)], "holds a list, not a state dict"),
    ({"model.norm.weight": 3}, "entry 'model.norm.weight' is a int, not a tensor"),
])
def test_a_pickle_that_is_not_a_state_dict_is_named(arcee_dir, content, fragment):
    (arcee_dir / "model.safetensors").unlink()
    torch.save(content, arcee_dir / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as info:
        HookedArcee.from_pretrained(arcee_dir)
    assert "pytorch_model.bin" in str(info.value) and fragment in str(info.value)
