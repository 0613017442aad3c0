"""Every value both families expose, read and written, against an independent oracle (tests/hooked_models/oracles.py).

Reading a value gives the reference's quantity (transformers' ArceeForCausalLM; the transcribed alpha-er
reference), bit for bit unless its table entry states a bound and why. Writing it (a random edit of one
position, and one head where the layout has heads) under its standard name and under each TransformerLens
name gives the logits of the reference with the same edit made inside it; read-only values refuse the write.
The table must cover exactly the values each model exposes.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: the oracle table sits beside this file
import oracles  # noqa: E402

from hooked_models import VALUES  # noqa: E402
from hooked_models.hooks import HookWriteError  # noqa: E402

ENTRIES = [(family, key) for family, table in oracles.ORACLES.items() for key in table]


@pytest.fixture(scope="module")
def pairs(tiny_factories):
    make_hf_arcee, make_reference_alpha_er = tiny_factories
    return oracles.make_pairs(make_hf_arcee(seed=4), make_reference_alpha_er(seed=4))


# ------------------------------------------------------------------------------------------- coverage
@pytest.mark.parametrize("family", list(oracles.ORACLES))
def test_every_value_has_an_oracle_and_every_oracle_a_value(pairs, family):
    pair = pairs[family]
    exposed, table = pair.templates(), set(oracles.ORACLES[family])
    assert not exposed - table, f"values without an oracle: {sorted(exposed - table)}"
    assert not table - exposed, f"oracles without a value: {sorted(table - exposed)}"
    for key, oracle in oracles.ORACLES[family].items():
        assert oracle.read_only == pair.value(pair.instances(key)[0]).read_only, key
        assert (oracle.read_bound == 0 and oracle.write_bound == 0) or oracle.why, f"{key}: a bound needs its reason"


def test_every_vocabulary_value_is_exposed_by_a_family(pairs):
    names = {pair.value(n).name for pair in pairs.values() for n in pair.model.standard_hook_dict}
    assert set(VALUES) <= names


def test_the_coverage_check_fails_on_a_value_without_an_oracle(pairs):
    """A value added to a model (here: a second hook on the final norm) is one the table does not cover."""
    from hooked_models.hooks import ValueHook

    model = pairs["arcee"].model
    model.norm.extra_probe = ValueHook("mlp_output")
    model.setup()
    try:
        assert pairs["arcee"].templates() - set(oracles.ORACLES["arcee"]) == {"norm.extra_probe"}
    finally:
        del model.norm.extra_probe
        model.setup()
    assert pairs["arcee"].templates() == set(oracles.ORACLES["arcee"])


# ------------------------------------------------------------------------- the oracles are the references
def test_arcee_harness_is_transformers(pairs, tiny_factories):
    """The recording attention functions give transformers' own "sdpa" and "eager" logits bit for bit (the
    eager steps are transcribed), the pattern is transformers' output_attentions, and the RMSNorm steps
    are its output."""
    pair = pairs["arcee"]
    twin = tiny_factories[0](seed=4)  # the same weights, left as transformers has them
    for eager, implementation in ((False, "sdpa"), (True, "eager")):
        probe = oracles.Probe()
        logits = pair.reference.run(pair.tokens, probe=probe, eager=eager)
        twin.set_attn_implementation(implementation)
        with torch.no_grad():
            theirs = twin(pair.tokens, output_attentions=eager)
        assert torch.equal(logits, theirs.logits), implementation
        if eager:
            for i, weights in enumerate(theirs.attentions):
                assert torch.equal(probe.seen[f"layers.{i}.self_attn.attention_probabilities"], weights)
        norms = {"layers.0.input_layernorm": "layers.0.attention_norm_output",
                 "layers.1.post_attention_layernorm": "layers.1.mlp_norm_output", "norm": "final_norm_output"}
        for norm, output in norms.items():
            weight = pair.reference.hf.get_submodule(f"model.{norm}").weight
            assert torch.equal(weight * probe.seen[f"{norm}.norm_normalized"], probe.seen[output])


def test_alpha_er_harness_is_the_reference(pairs):
    """The step-by-step forwards give the reference's logits bit for bit, the LayerNorms' definitions
    its fused output to rounding, and the head results sum to the output projection's output."""
    pair = pairs["alpha_er"]
    probe = oracles.Probe()
    logits = pair.reference.run(pair.tokens, probe=probe)
    with torch.no_grad():
        assert torch.equal(logits, pair.reference.reference(pair.tokens))
    ln = pair.reference.reference.blocks[1].ln2
    rebuilt = probe.seen["layers.1.post_attention_layernorm.norm_normalized"] * ln.weight + ln.bias
    torch.testing.assert_close(rebuilt, probe.seen["layers.1.mlp_norm_output"], rtol=0, atol=1e-6)
    proj = pair.reference.reference.blocks[0].proj
    results = probe.seen["layers.0.self_attn.attention_head_results"]
    bias = torch.nn.functional.linear(proj.mid_b, proj.up)
    torch.testing.assert_close(results.sum(-2) + bias, probe.seen["layers.0.self_attn.attention_output"],
                               rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------- read
@pytest.mark.parametrize("family,key", ENTRIES, ids=[f"{f}-{k}" for f, k in ENTRIES])
def test_read_is_the_references_value(pairs, family, key):
    oracle = oracles.ORACLES[family][key]
    for name, hooked, reference in pairs[family].read(key):
        assert reference is not None, f"the {family} reference never produced {name}"
        assert hooked.shape == reference.shape, f"{name}: {tuple(hooked.shape)} vs {tuple(reference.shape)}"
        assert oracles.within(hooked, reference, oracle.read_bound), (
            f"{name}: max |diff| {oracles.max_diff(hooked, reference):.3g}, bound {oracle.read_bound}")


# ------------------------------------------------------------------------------------------------ write
@pytest.mark.parametrize("family,key", ENTRIES, ids=[f"{f}-{k}" for f, k in ENTRIES])
def test_write_is_the_same_edit_in_the_reference(pairs, family, key):
    pair, oracle = pairs[family], oracles.ORACLES[family][key]
    if oracle.read_only:
        for name in pair.names_of(key):
            with pytest.raises(HookWriteError, match="read-only"):
                pair.model.run_with_hooks(pair.tokens, fwd_hooks=[(name, lambda t, hook: t.clone())])
        return
    hooked, reference, plain, keep = pair.write(key)
    assert not torch.equal(reference[keep], plain[keep]), f"the edit of {key} changes nothing: the test cannot fail"
    assert len(hooked) == len(pair.names_of(key))
    for name, logits in hooked.items():
        assert oracles.within(logits[keep], reference[keep], oracle.write_bound), (
            f"{name}: max |diff| {oracles.max_diff(logits[keep], reference[keep]):.3g}, bound {oracle.write_bound}")


def test_a_write_that_is_dropped_or_misplaced_fails(pairs):
    """The write check catches a hook whose write is lost, and one edited at another head (TL's layout
    read as the standard one)."""
    pair = pairs["arcee"]
    key = "layers.{i}.self_attn.attention_queries"
    _, reference, _, _ = pair.write(key)
    with torch.no_grad():
        dropped = pair.model(pair.tokens)
    assert not oracles.within(dropped, reference, 0)
    edit = pair.edit_for(key)
    wrong_axes = ("batch", "pos", "head", None)  # the standard layout is [batch head seq dim]

    def misplaced(tensor, hook):
        tensor = tensor.clone()
        edit.apply(tensor, wrong_axes)
        return tensor

    with torch.no_grad():
        logits = pair.model.run_with_hooks(pair.tokens, fwd_hooks=[("layers.0.self_attn.attention_queries", misplaced)])
    assert not oracles.within(logits, reference, 0)
