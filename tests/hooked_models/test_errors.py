"""Bad input gets a clear error, and nothing is left behind (issue 8).

Every bad input is a ValueError that names the value and the limit, through the forward,
run_with_cache and run_with_hooks alike; a bad hook is named with both shapes; an unknown hook name
gets the nearest names; and no failing run, however it fails, leaves a hook attached or memory held.
"""

import gc
import tracemalloc

import pytest
import torch

from hooked_models import AlphaErConfig, ArceeConfig, HookedAlphaEr, HookedArcee
from hooked_models.hooks import HookWriteError, UnknownHookError

VOCAB, MAX_POSITIONS = 23, 16


def random_arcee(num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 intermediate_size: int) -> HookedArcee:
    """A tiny random HookedArcee: errors do not need the oracle, only a model that runs."""
    torch.manual_seed(0)
    return HookedArcee(ArceeConfig(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads, head_dim=4, vocab_size=VOCAB,
                                   intermediate_size=intermediate_size, max_position_embeddings=MAX_POSITIONS)).eval()


@pytest.fixture(scope="module")
def model():
    return random_arcee(2, hidden_size=16, num_heads=4, num_kv_heads=2, intermediate_size=24)


@pytest.fixture(scope="module")
def model1():
    """One layer, for the test that runs a thousand times."""
    return random_arcee(1, hidden_size=8, num_heads=2, num_kv_heads=1, intermediate_size=8)


def random_alpha_er(num_layers: int) -> HookedAlphaEr:
    """A tiny HookedAlphaEr with random weights (its factored and expert weights start uninitialized):
    2 experts, so lengths must be even and at most block_size=8."""
    torch.manual_seed(0)
    model = HookedAlphaEr(AlphaErConfig(vocab_size=VOCAB, block_size=8, n_layer=num_layers, n_embd=8, n_head=2,
                                        ffn_dim=8, mlp_experts=2, lm_head_rank=3, attn_rank=3))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def alpha_er():
    return random_alpha_er(2)


@pytest.fixture(scope="module")
def alpha_er1():
    return random_alpha_er(1)


def tokens(batch=2, seq=6, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def read(x, hook):
    return None


def attached_hooks(model) -> int:
    """Hooks at both levels: TransformerLens's handles and PyTorch's own hook dicts."""
    return sum(len(p.fwd_hooks) + len(p.bwd_hooks) + len(p._forward_hooks) + len(p._backward_hooks)
               for p in model.standard_hook_dict.values())


def assert_clean(model):
    assert attached_hooks(model) == 0
    assert model.context_level == 0
    assert not model.is_caching


# ------------------------------------------------------------------------------------------- inputs
BAD_INPUTS = {
    "id past the vocabulary": (dict(input=torch.tensor([[1, VOCAB]])), [f"token id {VOCAB}", f"[0, {VOCAB})"]),
    "negative id": (dict(input=torch.tensor([[-3, 1]])), ["token id -3", f"[0, {VOCAB})"]),
    "empty sequence": (dict(input=torch.zeros(1, 0, dtype=torch.long)), ["empty", "(1, 0)"]),
    "empty batch": (dict(input=torch.zeros(0, 4, dtype=torch.long)), ["empty", "(0, 4)"]),
    "empty list": (dict(input=[]), ["token tensor", "list"]),
    "float tokens": (dict(input=tokens().float()), ["integer ids", "torch.float32"]),
    "bool tokens": (dict(input=tokens() > 3), ["integer ids", "torch.bool"]),
    "1-D tokens": (dict(input=tokens()[0]), ["2-D [batch seq]", "(6,)"]),
    "3-D tokens": (dict(input=tokens()[None]), ["2-D [batch seq]", "(1, 2, 6)"]),
    "mask of the wrong shape": (dict(input=tokens(), attention_mask=torch.ones(2, 5, dtype=torch.long)),
                                ["attention_mask has shape (2, 5)", "(2, 6)"]),
    "1-D mask": (dict(input=tokens(), attention_mask=torch.ones(6, dtype=torch.long)),
                 ["attention_mask has shape (6,)", "(2, 6)"]),
    "mask that is not 0/1": (dict(input=tokens(), attention_mask=torch.full((2, 6), 2)), ["only 0", "found 2"]),
    "fractional mask": (dict(input=tokens(), attention_mask=torch.full((2, 6), 0.5)), ["only 0", "found 0.5"]),
    "mask row with no token": (dict(input=tokens(), attention_mask=torch.tensor([[1] * 6, [0] * 6])),
                               ["no real token"]),
    "text without a tokenizer": (dict(input="hello"), ["no tokenizer"]),
}


FAMILY_INPUTS = {
    "model": {
        "past max_position_embeddings": (dict(input=torch.zeros(1, MAX_POSITIONS + 1, dtype=torch.long)),
                                         [f"{MAX_POSITIONS + 1}", f"{MAX_POSITIONS} positions"]),
    },
    "alpha_er": {
        "past block_size": (dict(input=torch.zeros(1, 10, dtype=torch.long)),
                            ["sequence length 10", "block_size=8"]),
        "not a multiple of the experts": (dict(input=torch.zeros(1, 5, dtype=torch.long)),
                                          ["sequence length 5", "multiple of mlp_experts=2", "pad the input"]),
        "left padding": (dict(input=tokens(), attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]] * 2)),
                         ["padding must be on the right"]),
    },
}
INPUT_CASES = [(fam, case) for fam in FAMILY_INPUTS for case in [*BAD_INPUTS, *FAMILY_INPUTS[fam]]]


@pytest.mark.parametrize("call", ["forward", "run_with_cache", "run_with_hooks"])
@pytest.mark.parametrize("family, case", INPUT_CASES)
def test_bad_input_is_a_clear_value_error(request, family, case, call):
    model = request.getfixturevalue(family)
    kwargs, fragments = {**BAD_INPUTS, **FAMILY_INPUTS[family]}[case]
    kwargs = dict(kwargs)
    args = (kwargs.pop("input"),)
    run = {
        "forward": lambda: model(*args, **kwargs),
        "run_with_cache": lambda: model.run_with_cache(*args, **kwargs),
        "run_with_hooks": lambda: model.run_with_hooks(*args, fwd_hooks=[("blocks.0.hook_resid_pre", read)],
                                                       **kwargs),
    }[call]
    with pytest.raises(ValueError) as info:  # an IndexError or RuntimeError from torch would not match
        run()
    assert info.type is ValueError, f"{info.type.__name__}: {info.value}"
    for fragment in fragments:
        assert fragment in str(info.value)
    assert_clean(model)


def test_good_masks_are_accepted_in_every_spelling(model):
    t = tokens()
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = model(t, attention_mask=mask)
        for spelling in (mask.bool(), mask.float(), mask.int()):
            torch.testing.assert_close(model(t, attention_mask=spelling), expected, rtol=0, atol=0)
        # The limit itself is allowed: max_position_embeddings positions exactly.
        assert model(torch.zeros(1, MAX_POSITIONS, dtype=torch.long)).shape == (1, MAX_POSITIONS, VOCAB)


def test_integer_ids_of_any_width_are_accepted(model):
    t = tokens()
    with torch.no_grad():
        expected = model(t)
        for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
            torch.testing.assert_close(model(t.to(dtype)), expected, rtol=0, atol=0)


def test_a_hook_that_writes_ids_outside_the_vocabulary_is_refused(model):
    with pytest.raises(ValueError, match=rf"a hook on input_ids wrote token id {VOCAB} .*\[0, {VOCAB}\)"):
        model.run_with_hooks(tokens(), fwd_hooks=[("input_ids", lambda x, hook: torch.full_like(x, VOCAB))])
    with pytest.raises(ValueError, match="a hook on attention_mask wrote a mask that must hold only 0"):
        model.run_with_hooks(tokens(), fwd_hooks=[("attention_mask", lambda x, hook: x * 3)])
    assert_clean(model)


# -------------------------------------------------------------------------------------------- hooks
WRONG_WRITES = [
    # (hook name, what the hook returns, the name(s) the error must give, the shapes it must give)
    ("layers.0.layer_input", lambda x, hook: x[:, :-1], ["'layers.0.layer_input'"], ["(2, 5, 16)", "(2, 6, 16)"]),
    ("blocks.0.hook_resid_pre", lambda x, hook: x[:, :-1], ["'blocks.0.hook_resid_pre'", "'layers.0.layer_input'"],
     ["(2, 5, 16)", "(2, 6, 16)"]),
    ("layers.1.mlp.mlp_neurons", lambda x, hook: x.double(), ["'layers.1.mlp.mlp_neurons'"],
     ["(2, 6, 24) torch.float64", "(2, 6, 24) torch.float32"]),
    ("blocks.1.mlp.hook_post", lambda x, hook: x.half(), ["'blocks.1.mlp.hook_post'"],
     ["torch.float16", "torch.float32"]),
    # TransformerLens's layout [batch pos head d_head] is what the alias's user saw, so the shapes are in it.
    ("blocks.0.attn.hook_q", lambda x, hook: x[..., :-1],
     ["'blocks.0.attn.hook_q'", "'layers.0.self_attn.attention_queries_unrotated'"], ["(2, 6, 4, 3)", "(2, 6, 4, 4)"]),
    # A wrong number of dimensions must not reach einops, whose error would name neither.
    ("blocks.0.attn.hook_z", lambda x, hook: x[0], ["'blocks.0.attn.hook_z'"], ["(6, 4, 4)", "(2, 6, 4, 4)"]),
    ("layers.0.self_attn.attention_keys", lambda x, hook: torch.cat([x, x], 1),
     ["'layers.0.self_attn.attention_keys'"], ["(2, 4, 6, 4)", "(2, 2, 6, 4)"]),
    ("logits", lambda x, hook: x[..., :3], ["'logits'"], ["(2, 6, 3)", f"(2, 6, {VOCAB})"]),
]


@pytest.mark.parametrize("name, write, names, shapes", WRONG_WRITES, ids=[w[0] for w in WRONG_WRITES])
@pytest.mark.parametrize("call", ["run_with_hooks", "hooks", "run_with_cache"])
def test_a_wrong_write_names_the_hook_and_both_shapes(model, name, write, names, shapes, call):
    with pytest.raises(HookWriteError) as info:
        if call == "run_with_hooks":
            model.run_with_hooks(tokens(), fwd_hooks=[(name, write)])
        elif call == "hooks":
            with model.hooks(fwd_hooks=[(name, write)]):
                model(tokens())
        else:
            with model.hooks(fwd_hooks=[(name, write)]):
                model.run_with_cache(tokens())
    assert isinstance(info.value, ValueError)
    for fragment in names + shapes:
        assert fragment in str(info.value)
    assert_clean(model)


@pytest.mark.parametrize("name", ["input_size", "next_token_probs"])
def test_writing_a_read_only_value_is_refused(model, name):
    with pytest.raises(HookWriteError, match=rf"'{name}'.*read-only"):
        model.run_with_hooks(tokens(), fwd_hooks=[(name, lambda x, hook: x.clone())])
    assert_clean(model)


def test_a_hook_returning_a_non_tensor_is_refused(model):
    with pytest.raises(HookWriteError, match=r"'blocks.1.hook_resid_post'.*returned list"):
        model.run_with_hooks(tokens(), fwd_hooks=[("blocks.1.hook_resid_post", lambda x, hook: [x])])


UNKNOWN_NAMES = [
    # (unknown name, what the error must suggest)
    ("blocks.1.hook_resid_pr", "'blocks.1.hook_resid_pre'"),
    ("blocks.0.attn.hook_patern", "'blocks.0.attn.hook_pattern'"),
    ("layers.1.self_attn.attention_query", "'layers.1.self_attn.attention_queries'"),
    ("layers.0.mlp.mlp_neuron", "'layers.0.mlp.mlp_neurons'"),
    ("layers.0.mlp.hook_post", "'blocks.0.mlp.hook_post'"),  # a standard path with a TL hook name
    ("ln_final.hook_scal", "'ln_final.hook_scale'"),
    ("logit", "'logits'"),
    ("resid_pre", "'blocks.0.hook_resid_pre'"),  # a bare TransformerLens shorthand
    ("hook_attn_out", "'blocks.0.hook_attn_out'"),
    ("blocks.7.hook_resid_pre", "layer 7 is out of range, the model has 2 layers (0 to 1)"),
    ("layers.2.layer_output", "layer 2 is out of range"),
]


@pytest.mark.parametrize("name, suggestion", UNKNOWN_NAMES, ids=[u[0] for u in UNKNOWN_NAMES])
def test_an_unknown_name_suggests_the_nearest(model, name, suggestion):
    for attempt in (
        lambda: model.run_with_hooks(tokens(), fwd_hooks=[(name, read)]),
        lambda: model.run_with_cache(tokens(), names_filter=[name]),
        lambda: model.add_hook(name, read),
        lambda: model.resolve_hook_name(name),
    ):
        with pytest.raises(UnknownHookError) as info:
            attempt()
        assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
        assert f"no hook named {name!r}" in str(info.value)
        assert suggestion in str(info.value), str(info.value)
        assert_clean(model)


# Everyday words (TransformerLens's shorthands, nnterp's accessors, common spellings), bare and at a
# layer: (word, value it means, where the value sits under layers.{i}).
SYNONYM_CASES = [
    ("pattern", "self_attn.attention_probabilities"), ("attn_pattern", "self_attn.attention_probabilities"),
    ("attention_pattern", "self_attn.attention_probabilities"), ("attn_scores", "self_attn.attention_scores"),
    ("scores", "self_attn.attention_scores"), ("resid_pre", "layer_input"), ("resid_mid", "layer_mid"),
    ("resid_post", "layer_output"), ("mlp_out", "mlp.mlp_output"), ("attn_out", "self_attn.attention_output"),
    ("attentions_output", "self_attn.attention_output"), ("mlps_output", "mlp.mlp_output"),
    ("layers_output", "layer_output"), ("layers_input", "layer_input"), ("q", "self_attn.attention_queries_unrotated"),
    ("k", "self_attn.attention_keys_unrotated"), ("rot_q", "self_attn.attention_queries"),
    ("v", "self_attn.attention_values"), ("z", "self_attn.attention_head_outputs"),
    ("hook_z", "self_attn.attention_head_outputs"),
    ("result", "self_attn.attention_head_results"), ("pre", "mlp.mlp_pre_activation"), ("post", "mlp.mlp_neurons"),
    ("neurons", "mlp.mlp_neurons"),
]


@pytest.mark.parametrize("form", ["{word}", "layers.1.self_attn.{word}", "blocks.1.{word}"])
@pytest.mark.parametrize("word, value", SYNONYM_CASES, ids=[c[0] for c in SYNONYM_CASES])
def test_a_synonym_suggests_the_value_it_means(model, word, value, form):
    layer = "0" if form == "{word}" else "1"
    name = form.format(word=word)
    with pytest.raises(UnknownHookError) as info:
        model.resolve_hook_name(name)
    assert f"did you mean 'layers.{layer}.{value}'" in str(info.value), str(info.value)


@pytest.mark.parametrize("name, suggestion", [
    ("q", "'layers.0.self_attn.attention_queries' (TransformerLens 'blocks.0.attn.hook_rot_q')"),  # no rotary
    ("pos_embed", "'position_embeddings'"),
    ("layers.1.experts", "'layers.1.mlp.mlp_expert_index'"),
    ("raw_scores", "'layers.0.self_attn.score_mod.attention_raw_scores'"),
    ("unembed", "'lm_head_output'"),
    ("scale", "'layers.0.input_layernorm.norm_scale' (TransformerLens 'blocks.0.ln1.hook_scale') or "
              "'layers.0.post_attention_layernorm.norm_scale'"),
])
def test_alpha_er_synonyms_suggest_its_values(alpha_er, name, suggestion):
    with pytest.raises(UnknownHookError) as info:
        alpha_er.resolve_hook_name(name)
    assert suggestion in str(info.value), str(info.value)


ALPHA_ER_WRITES = [
    ("layers.0.self_attn.qkv_proj.bottleneck", lambda x, hook: x[..., :2], ["'layers.0.self_attn.qkv_proj.bottleneck'"],
     ["(2, 6, 2)", "(2, 6, 3)"]),
    ("hook_pos_embed", lambda x, hook: x[:, :4], ["'hook_pos_embed'", "'position_embeddings'"],
     ["(2, 4, 8)", "(2, 6, 8)"]),
    ("blocks.1.attn.hook_q", lambda x, hook: x.transpose(1, 2).contiguous(),
     ["'blocks.1.attn.hook_q'", "'layers.1.self_attn.attention_queries'"], ["(2, 2, 6, 4)", "(2, 6, 2, 4)"]),
    ("layers.1.mlp.mlp_expert_index", lambda x, hook: x, ["'layers.1.mlp.mlp_expert_index'", "read-only"], []),
]


@pytest.mark.parametrize("name, write, names, shapes", ALPHA_ER_WRITES, ids=[w[0] for w in ALPHA_ER_WRITES])
def test_alpha_er_wrong_write_names_the_hook_and_both_shapes(alpha_er, name, write, names, shapes):
    with pytest.raises(HookWriteError) as info:
        alpha_er.run_with_hooks(tokens(), fwd_hooks=[(name, write)])
    for fragment in names + shapes:
        assert fragment in str(info.value), str(info.value)
    assert_clean(alpha_er)


@pytest.mark.parametrize("name, suggestion", [
    ("layers.1.self_attn.o_proj.botleneck", "'layers.1.self_attn.o_proj.bottleneck'"),
    ("layers.0.mlp.mlp_expert", "'layers.0.mlp.mlp_expert_index'"),
    ("hook_pos_emb", "'hook_pos_embed'"),
    ("blocks.2.hook_resid_pre", "layer 2 is out of range, the model has 2 layers (0 to 1)"),
])
def test_alpha_er_unknown_name_suggests_the_nearest(alpha_er, name, suggestion):
    with pytest.raises(UnknownHookError) as info:
        alpha_er.run_with_hooks(tokens(), fwd_hooks=[("logits", read), (name, read)])
    assert suggestion in str(info.value), str(info.value)
    assert_clean(alpha_er)


def test_the_cache_suggests_names_too(model):
    _, cache = model.run_with_cache(tokens())
    with pytest.raises(KeyError, match=r"did you mean 'blocks.1.hook_resid_post'"):
        cache["blocks.1.hook_resid_pots"]


# ------------------------------------------------------------------------------------------ cleanup
def fail_in_hook(x, hook):
    raise RuntimeError("the user's hook failed")


FAILING_RUNS = {
    "hook raised": lambda m: m.run_with_hooks(tokens(), fwd_hooks=[("blocks.0.hook_resid_pre", read),
                                                                   ("blocks.0.hook_mlp_out", fail_in_hook)]),
    "second name unknown": lambda m: m.run_with_hooks(tokens(), fwd_hooks=[("blocks.0.hook_resid_pre", read),
                                                                           ("blocks.0.hook_nope", read)]),
    "filter raised after a name attached": lambda m: m.run_with_hooks(
        tokens(), fwd_hooks=[("logits", read), (lambda name: name.nope, read)]),
    "forward raised (bad tokens)": lambda m: m.run_with_hooks(torch.tensor([[VOCAB]]),
                                                              fwd_hooks=[("blocks.0.hook_resid_pre", read)]),
    "wrong write": lambda m: m.run_with_hooks(tokens(), fwd_hooks=[("blocks.0.attn.hook_z", lambda x, hook: x[0])]),
    "cache, forward raised": lambda m: m.run_with_cache(tokens(), attention_mask=torch.ones(3, 3)),
    "cache, second name unknown": lambda m: m.run_with_cache(tokens(), names_filter=["logits", "logitz"]),
    "cache with a hook that raised": lambda m: _cache_inside_hooks(m),
    "hooks(), body raised": lambda m: _hooks_body_raises(m),
    "hooks(), second name unknown": lambda m: _hooks_second_unknown(m),
    "generate, hook raised at step 2": lambda m: _generate_fails_at_step_two(m),
}


def _cache_inside_hooks(m):
    with m.hooks(fwd_hooks=[("blocks.0.ln1.hook_scale", fail_in_hook)]):
        m.run_with_cache(tokens())


def _hooks_body_raises(m):
    with m.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", read), ("blocks.0.attn.hook_pattern", read)]):
        m(tokens())
        raise RuntimeError("the user's code failed")


def _generate_fails_at_step_two(m):
    calls = []

    def second_call_fails(x, hook):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the user's hook failed at step 2")

    m.generate(tokens(), max_new_tokens=2, fwd_hooks=[("blocks.0.hook_resid_pre", read), ("logits", second_call_fails)],
               stop_at_eos=False, verbose=False)


def _hooks_second_unknown(m):
    with m.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", read), ("blocks.9.hook_resid_pre", read)]):
        pass


@pytest.mark.parametrize("family", ["model", "alpha_er"])
@pytest.mark.parametrize("case", list(FAILING_RUNS))
def test_a_failing_run_leaves_nothing_behind(request, family, case):
    model = request.getfixturevalue(family)
    with torch.no_grad():
        before = model(tokens())
    permanent = []
    model.add_hook("blocks.1.hook_resid_mid", lambda x, hook: permanent.append(1), is_permanent=True)
    try:
        with pytest.raises((ValueError, RuntimeError, AttributeError)):
            FAILING_RUNS[case](model)
        # Only the user's permanent hook is left, and it still fires.
        assert attached_hooks(model) == 2  # one TransformerLens handle + the PyTorch hook under it
        assert model.context_level == 0 and not model.is_caching
        with torch.no_grad():
            after = model(tokens())
        assert permanent
        torch.testing.assert_close(after, before, rtol=0, atol=0)
    finally:
        model.reset_hooks(including_permanent=True)
    assert_clean(model)


@pytest.mark.parametrize("family", ["model1", "alpha_er1"])
def test_a_thousand_failing_runs_leave_no_hook_and_no_memory(request, family):
    """Each kind of failure, over and over: hooks, Python objects, live tensors and traced memory
    stay where they were."""
    model1 = request.getfixturevalue(family)
    kinds = list(FAILING_RUNS.values())

    def fail(i):
        try:
            kinds[i % len(kinds)](model1)
        except (ValueError, RuntimeError, AttributeError):
            pass
        else:
            raise AssertionError(f"the run should have failed: {list(FAILING_RUNS)[i % len(kinds)]}, run {i}")

    def census():
        gc.collect()
        objects = gc.get_objects()
        return len(objects), sum(type(o) in (torch.Tensor, torch.nn.Parameter) for o in objects)

    n = len(kinds)
    with torch.no_grad():
        for i in range(5 * n):  # warm up: lazily built tables, interned strings, the allocator
            fail(i)
        objects_before, tensors_before = census()
        for i in range(1000 - 20 * n):
            fail(i)
        # tracemalloc slows every allocation several times, so it traces the last 15 cycles of the
        # failure kinds only, as three windows. A dict that happens to resize inside a window shows
        # there once; a leak shows in every window, so the smallest growth is the measure.
        growths = []
        tracemalloc.start()
        try:
            for _ in range(3):
                gc.collect()
                start, _ = tracemalloc.get_traced_memory()
                for i in range(5 * n):
                    fail(i)
                gc.collect()
                growths.append(tracemalloc.get_traced_memory()[0] - start)
        finally:
            tracemalloc.stop()
        objects_after, tensors_after = census()
    assert_clean(model1)
    assert tensors_after == tensors_before
    # A leaked hook, handle, frame or cache entry per run would add thousands of objects.
    assert objects_after - objects_before < 100, f"{objects_after - objects_before} objects more after 1000 runs"
    # One leaked hook is ~1.3 KB (measured below): 5 cycles of runs leaking one each would be ~80 KB.
    assert min(growths) < 16 * 1024, f"memory grew by {growths} bytes in three windows of {5 * n} failing runs"


def test_the_leak_measure_can_fail(model):
    """The same measure sees a leak of one small hook per run (so the test above is not vacuous)."""
    growths = []
    tracemalloc.start()
    try:
        for _ in range(3):
            start, _ = tracemalloc.get_traced_memory()
            for _ in range(5 * len(FAILING_RUNS)):
                model.add_hook("logits", lambda x, hook: None)
            growths.append(tracemalloc.get_traced_memory()[0] - start)
    finally:
        tracemalloc.stop()
        leaked = attached_hooks(model)
        model.reset_hooks()
    assert leaked == 2 * 15 * len(FAILING_RUNS) and min(growths) > 16 * 1024, growths
    assert_clean(model)
