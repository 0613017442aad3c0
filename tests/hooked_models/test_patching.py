"""hooked_models.patching against transformer_lens.patching and against one forward per patch."""

import pytest
import torch
import transformer_lens.patching as tl_patching

from hooked_models import patching
from hooked_models.patching.runner import _chunks, _Job

SEQ = 8


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(1)
    clean = torch.randint(3, 97, (2, SEQ), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 2] = (clean[:, 2] + 11) % 94 + 3
    corrupted[:, 5] = (clean[:, 5] + 23) % 94 + 3
    return clean, corrupted


def metric(logits):
    return patching.logit_diff_metric([5, 6], [7, 8])(logits)


def test_residual_sweep_matches_transformer_lens(tiny_arcee, prompts):
    clean, corrupted = prompts
    ours = patching.activation_patch(tiny_arcee, clean, corrupted, metric, "layer_input", ("layer", "pos"))
    with torch.no_grad():
        _, clean_cache = tiny_arcee.run_with_cache(clean)
        reference = tl_patching.get_act_patch_resid_pre(tiny_arcee, corrupted, clean_cache, metric)
    assert ours.axes == ("layer", "seq") and ours.values.shape == (2, SEQ)
    torch.testing.assert_close(ours.values, reference.float().cpu(), rtol=1e-5, atol=1e-5)
    # Patching a position the prompts agree on changes nothing; a differing one does.
    assert torch.equal(ours.values[0, 0], torch.tensor(ours.corrupted_metric))
    assert ours.values[0, 2] != ours.corrupted_metric


@pytest.mark.parametrize("value, over, reference", [
    ("attention_head_outputs", ("layer", "head"), tl_patching.get_act_patch_attn_head_out_all_pos),
    ("attention_keys", ("layer", "head"), tl_patching.get_act_patch_attn_head_k_all_pos),
    ("attention_values", ("layer", "head"), tl_patching.get_act_patch_attn_head_v_all_pos),
    ("attention_queries", ("layer", "head"), tl_patching.get_act_patch_attn_head_q_all_pos),
    ("attention_probabilities", ("layer", "head"), tl_patching.get_act_patch_attn_head_pattern_all_pos),
    ("mlp_output", ("layer", "pos"), tl_patching.get_act_patch_mlp_out),
    ("layer_mid", ("layer", "pos"), tl_patching.get_act_patch_resid_mid),
])
def test_head_and_mlp_sweeps_match_transformer_lens(tiny_arcee, prompts, value, over, reference):
    clean, corrupted = prompts
    ours = patching.activation_patch(tiny_arcee, clean, corrupted, metric, value, over)
    with torch.no_grad():
        _, clean_cache = tiny_arcee.run_with_cache(clean)
        expected = reference(tiny_arcee, corrupted, clean_cache, metric)
    # Keys and values are swept by key/value head (2 of them), queries and outputs by query head (10).
    heads = 2 if value in ("attention_keys", "attention_values") else 10
    assert ours.values.shape == (2, heads if "head" in over else SEQ)
    torch.testing.assert_close(ours.values, expected.float().cpu(), rtol=1e-5, atol=1e-5)


def one_forward_per_patch(model, base, source, value, index_of):
    """The plain loop: one hooked forward per patch, written out here as the reference.

    `index_of(activation)` lists (key, index): the result is keyed by (layer, *key).
    """
    sites = patching.find_sites(model, value)
    with torch.no_grad():
        _, cache = model.run_with_cache(source, names_filter=[s.name for s in sites])
        results = {}
        for site in sites:
            for key, index in index_of(cache[site.name]):
                def hook(activation, hook, index=index, name=site.name):
                    patched = activation.clone()
                    patched[(slice(None), *index)] = cache[name][(slice(None), *index)]
                    return patched
                results[(site.layer, *key)] = float(
                    metric(model.run_with_hooks(base, fwd_hooks=[(site.name, hook)])))
    return results


def test_batched_equals_one_forward_per_patch(tiny_arcee, prompts):
    clean, corrupted = prompts
    loop = one_forward_per_patch(tiny_arcee, corrupted, clean, "mlp_neurons",
                                 lambda a: [((n,), (slice(None), n)) for n in range(a.shape[-1])])
    expected = torch.tensor([[loop[(layer, n)] for n in range(56)] for layer in range(2)])
    # Neurons by layer × neuron; with 7 patches a forward, chunk boundaries land mid-layer.
    for batch_size in (None, 1, 7):
        ours = patching.activation_patch(tiny_arcee, clean, corrupted, metric, "mlp_neurons", ("layer", "neuron"),
                                         batch_size=batch_size)
        torch.testing.assert_close(ours.values, expected, rtol=1e-5, atol=1e-6)
    assert ours.effect().abs().max() > 0.01


def test_noising_and_head_by_position_match_the_loop(tiny_arcee, prompts):
    clean, corrupted = prompts
    ours = patching.activation_patch(tiny_arcee, clean, corrupted, metric, "attention_head_outputs",
                                     ("layer", "pos", "head"), direction="noising", select={"pos": [2, 5, 7]})
    assert ours.axes == ("layer", "seq", "num_heads") and ours.values.shape == (2, 3, 10)
    assert ours.labels["seq"] == ["2", "5", "7"] and ours.labels["num_heads"][3] == "H3"
    loop = one_forward_per_patch(tiny_arcee, clean, corrupted, "attention_head_outputs",
                                 lambda a: [((p, h), (p, h)) for p in (2, 5, 7) for h in range(10)])
    expected = torch.tensor([[[loop[(layer, p, h)] for h in range(10)] for p in (2, 5, 7)] for layer in range(2)])
    torch.testing.assert_close(ours.values, expected, rtol=1e-5, atol=1e-6)
    assert ours.baseline == ours.clean_metric


def test_whole_layer_patch_restores_the_clean_run(tiny_arcee, prompts):
    clean, corrupted = prompts
    for direction in ("denoising", "noising"):
        result = patching.activation_patch(tiny_arcee, clean, corrupted, metric, "layer_input", ("layer",),
                                           direction=direction)
        target = 1.0 if direction == "denoising" else 0.0
        torch.testing.assert_close(result.normalized(), torch.full((2,), target), rtol=0, atol=1e-5)
    assert result.clean_metric != result.corrupted_metric


def test_a_patch_runs_from_its_layer_and_its_first_changed_position(tiny_arcee, prompts):
    clean, corrupted = prompts
    seen = {0: [], 1: []}
    hooks = [(f"layers.{i}.layer_input", lambda x, hook, i=i: seen[i].append(tuple(x.shape[:2]))) for i in (0, 1)]
    with tiny_arcee.hooks(fwd_hooks=hooks):
        result = patching.activation_patch(tiny_arcee, clean, corrupted, metric, "layer_input", ("layer", "pos"),
                                           select={"layer": [1], "pos": [5]})
        heads = patching.activation_patch(tiny_arcee, clean, corrupted, metric, "attention_head_outputs",
                                          ("layer", "head"), select={"layer": [1]})
    # Layer 0 ran for the clean and corrupted runs only; layer 1 also for the patched copy, positions 5-7;
    # the 10 head patches (every position) from position 2, the prompts' first difference.
    assert seen == {0: [(2, SEQ)] * 4, 1: [(2, SEQ), (2, SEQ), (2, 3), (2, SEQ), (2, SEQ), (20, 6)]}
    with torch.no_grad():
        _, clean_cache = tiny_arcee.run_with_cache(clean)
        expected = tl_patching.get_act_patch_resid_pre(tiny_arcee, corrupted, clean_cache, metric)
        expected_heads = tl_patching.get_act_patch_attn_head_out_all_pos(tiny_arcee, corrupted, clean_cache, metric)
    torch.testing.assert_close(result.values[0, 0], expected[1, 5].float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(heads.values[0], expected_heads[1].float(), rtol=1e-5, atol=1e-6)


def forwards(model, run) -> list[int]:
    """The rows of each forward that computes logits while `run()` runs."""
    rows = []
    with model.hooks(fwd_hooks=[("logits", lambda logits, hook: rows.append(logits.shape[0]))]):
        run()
    return rows


def test_the_memory_budget_sets_the_copies_per_forward(tiny_arcee, prompts):
    clean, corrupted = prompts

    def sweep(**options):
        return patching.activation_patch(tiny_arcee, clean, corrupted, metric, "attention_head_outputs",
                                         ("layer", "head"), **options)

    # The 20 head patches (all positions) each change positions 2 ... only: a copy costs row_bytes from there.
    per_copy = patching.row_bytes(tiny_arcee, corrupted, start=2)
    assert per_copy > patching.row_bytes(tiny_arcee, corrupted, start=3)
    # Two unpatched runs, then the patched copies of the 2 prompts: all 20 at once when they fit, no
    # more than 7 a forward within 7 copies' bytes, one at a time when not even one fits.
    assert forwards(tiny_arcee, lambda: sweep()) == [2, 2, 40]
    assert forwards(tiny_arcee, lambda: sweep(memory_budget=7 * per_copy)) == [2, 2, 14, 14, 12]
    assert forwards(tiny_arcee, lambda: sweep(memory_budget=1)) == [2, 2] + [2] * 20
    assert forwards(tiny_arcee, lambda: sweep(batch_size=8)) == [2, 2, 16, 16, 8]
    # The chunks change nothing but rounding (test_results_equal_one_forward_per_patch gives the bound).
    bound = 4 * torch.finfo(torch.float32).eps * tiny_arcee(corrupted).abs().max()
    default = sweep().values
    for options in ({"memory_budget": 1}, {"memory_budget": 7 * per_copy}, {"batch_size": 3}):
        assert (sweep(**options).values - default).abs().max() <= bound
    for bad in (0, -5, True):
        with pytest.raises(ValueError, match=f"memory_budget={bad!r} must be a positive integer"):
            sweep(memory_budget=bad)


def test_the_default_budget_is_half_the_free_memory(tiny_arcee, prompts, monkeypatch):
    clean, corrupted = prompts
    asked = []

    def free(device):
        asked.append(torch.device(device).type)
        return 2 * 5 * patching.row_bytes(tiny_arcee, corrupted, start=2)  # half of it: 5 copies

    monkeypatch.setattr("hooked_models.patching.activation.free_memory", free)
    rows = forwards(tiny_arcee, lambda: patching.activation_patch(
        tiny_arcee, clean, corrupted, metric, "attention_head_outputs", ("layer", "head")))
    assert asked == ["cpu"] and rows == [2, 2, 10, 10, 10, 10]


def test_free_memory_reads_the_device():
    from hooked_models.devices import free_memory

    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    # Other processes allocate and free between the two reads: within 5% of each other.
    assert abs(free_memory("cpu") - available) < 0.05 * available


def test_starts_share_a_forward_when_that_is_cheaper():
    """Patches of one start share a forward; the next start's join it while the positions they then
    run for nothing cost less than the layer calls a forward of their own would."""
    jobs = [_Job(row, patching.Patch("layers.0.layer_input", (None, None)), stage, start)
            for row, (stage, start) in enumerate([(0, 1), (1, 1), (0, 2), (1, 2), (1, 6)])]

    def chunks(call_rows: float, capacity=100):
        found = _chunks(jobs, 4, 14, 2, lambda start: capacity, call_rows)
        return [[job.row for job in chunk] for chunk in found]

    # Overhead-bound (a tiny model): one forward. Compute-bound: a forward per start.
    assert chunks(call_rows=1000.0) == [[0, 1, 2, 3, 4]]
    assert chunks(call_rows=1.0) == [[0, 1], [2, 3], [4]]
    # In between, 10 rows a layer call: start 2 joins start 1 (its copies of the 4 prompts run one position
    # more through their 3 and 2 stages: 20 rows, against 3 layer calls saved); start 6 does not (4 more
    # positions through 2 stages: 32 rows, against 2 calls).
    assert chunks(call_rows=10.0) == [[0, 1, 2, 3], [4]]
    # The memory budget caps a forward: a start's jobs split in stage order, a merge must fit too.
    assert chunks(call_rows=1000.0, capacity=3) == [[0, 1], [2, 3, 4]]


# ------------------------------------------------------------------ every value kind against the plain loop
def plain_loop(model, base, source, metric, value, over, select, attention_mask):
    """The reference: one full forward per patch, each writing the source run's values over the patch's
    region (every position of every prompt it indexes) with a plain `torch.where`. The patches and
    their order are the plan's (`patching.plan`, which the label tests above check)."""
    sites = patching.find_sites(model, value)
    with torch.no_grad():
        _, cache = model.run_with_cache(source, names_filter=[s.name for s in sites], attention_mask=attention_mask)
        sizes = [dict(zip(s.value.dims[1:], cache[s.name].shape[1:])) for s in sites]
        grid, patches = patching.plan(model, sites, over, select, sizes)
        values = []
        for patch in patches:
            shape = cache[patch.site].shape[1:]
            region = torch.ones(shape, dtype=torch.bool)
            for d, selector in enumerate(patch.index):
                if selector is not None:
                    line = torch.zeros(shape[d], dtype=torch.bool)
                    line[list(selector) if isinstance(selector, tuple) else selector] = True
                    region &= line.view([-1 if i == d else 1 for i in range(len(shape))])

            def write(activation, hook, region=region, source=cache[patch.site]):
                return torch.where(region, source, activation)

            logits = model.run_with_hooks(base, attention_mask=attention_mask, fwd_hooks=[(patch.site, write)])
            values.append(float(metric(logits)))
    return torch.tensor(values).reshape(grid.shape)


def every_position_metric(attention_mask):
    """logit(5) − logit(7) averaged over every real position: a patch's effect anywhere shows, and so
    would a wrong logit at a position before the patch (those come from the unpatched run)."""
    def metric(logits):
        weight = torch.ones(logits.shape[:2]) if attention_mask is None else attention_mask.float()
        return ((logits[..., 5] - logits[..., 7]).float() * weight).sum() / weight.sum()
    return metric


SWEEPS = [  # (value, over, select): each value kind the module sweeps, by its usual axes and others
    ("layer_input", ("layer", "pos"), None),
    ("layer_mid", ("layer", "pos"), None),
    ("layer_output", ("layer",), None),
    ("attention_output", ("layer", "pos"), None),
    ("mlp_output", ("layer", "pos"), None),
    ("attention_norm_output", ("layer", "pos"), {"pos": [1, 2, 6]}),
    ("attention_head_outputs", ("layer", "head"), None),
    ("attention_head_outputs", ("layer", "pos", "head"), {"pos": [2, 5, 7], "head": [0, 3]}),
    ("attention_head_results", ("layer", "head"), None),
    ("attention_keys", ("layer", "kv_head"), None),
    ("attention_values", ("layer", "pos"), None),
    ("attention_queries", ("layer", "head"), None),
    ("attention_probabilities", ("layer", "head"), None),
    ("attention_scores", ("layer", "src_pos"), None),
    ("attention_probabilities", ("layer", "dest_pos", "head"), {"dest_pos": [3, 6], "head": [1, 2]}),
    ("mlp_neurons", ("layer", "neuron"), {"neuron": [0, 5, 17, 30, 47]}),
    ("mlp_pre_activation", ("layer", "pos"), None),
    ("token_embeddings", ("pos",), None),
    ("final_norm_output", ("pos",), None),
    ("logits", ("pos",), None),
]
ALPHA_ER_SWEEPS = [
    ("mlp_output", ("layer", "expert"), None),
    ("mlp_neurons", ("layer", "expert"), None),
    ("qkv_proj.bottleneck", ("layer", "rank"), None),
    ("o_proj.bottleneck_normed", ("layer", "pos"), None),
    ("lm_head.bottleneck_normed", ("rank",), None),
    ("attention_raw_scores", ("layer", "head"), None),
    ("position_embeddings", ("pos",), None),
]


@pytest.mark.parametrize("family, value, over, select", [("arcee", *sweep) for sweep in SWEEPS] + [
    ("alpha_er", *sweep) for sweep in SWEEPS + ALPHA_ER_SWEEPS])
def test_results_equal_one_forward_per_patch(tiny_arcee, alpha_er, prompts, family, value, over, select):
    """Every value kind, both directions, both families, with and without padding: the result equals
    the plain loop's to float32 rounding.

    Not bit for bit: each patched run computes its window of layers and positions in other matmul
    shapes than a full forward (a matmul's rounding depends on its row count with this torch's CPU
    BLAS) and reads the earlier positions' keys from a cache (the window alone:
    tests/hooked_models/components/test_kv_cache.py). Measured: at most 0.9 float32 epsilons of the
    largest logit apart; the bound is 4.
    """
    model = tiny_arcee if family == "arcee" else alpha_er
    clean, corrupted = (p % model.cfg.vocab_size for p in prompts)
    padded = torch.ones_like(clean)
    if family == "arcee":
        padded[1, :2] = 0  # left padding
    else:
        padded[0, 6:] = 0  # right padding, alpha-er's rule
    for direction, mask in (("denoising", None), ("noising", padded)):
        metric = every_position_metric(mask)
        ours = patching.activation_patch(model, clean, corrupted, metric, value, over, direction=direction,
                                         select=select, attention_mask=mask)
        base, source = (corrupted, clean) if direction == "denoising" else (clean, corrupted)
        expected = plain_loop(model, base, source, metric, value, over, select, mask)
        bound = 4 * torch.finfo(torch.float32).eps * model(base, attention_mask=mask).abs().max()
        assert ours.values.shape == expected.shape
        assert (ours.values - expected).abs().max() <= bound, (direction, (ours.values - expected).abs().max())
        # Non-trivial: the sweep moves the metric (alpha-er's positions are the same in both runs).
        assert (expected != ours.baseline).any() == (value != "position_embeddings")


def test_progress_bar_when_asked(tiny_arcee, prompts, capsys):
    clean, corrupted = prompts
    patching.activation_patch(tiny_arcee, clean, corrupted, metric, "layer_input", batch_size=4, progress=True)
    assert "16/16" in capsys.readouterr().err
    patching.activation_patch(tiny_arcee, clean, corrupted, metric, "layer_input", batch_size=4, progress=False)
    assert capsys.readouterr().err == ""


SWEEPS = {
    "activation_patch": lambda model, clean, corrupted, progress: patching.activation_patch(
        model, clean, corrupted, metric, "layer_input", batch_size=4, progress=progress),
    "patch_attention_heads": lambda model, clean, corrupted, progress: patching.patch_attention_heads(
        model, clean, corrupted, metric, batch_size=3, progress=progress),
}


@pytest.mark.parametrize("sweep", SWEEPS)
def test_a_progress_callable_sees_every_patch(tiny_arcee, prompts, progress_checks, sweep):
    clean, corrupted = prompts
    probe = progress_checks.Probe()
    result = SWEEPS[sweep](tiny_arcee, clean, corrupted, probe)
    probe.check_complete("patch")
    assert probe.steps[-1].total == result.values.numel() and len(probe.steps) > 2
    assert torch.equal(result.values, SWEEPS[sweep](tiny_arcee, clean, corrupted, False).values)


@pytest.mark.parametrize("sweep", SWEEPS)
def test_cancelling_a_sweep_leaves_the_model_as_it_was(tiny_arcee, prompts, progress_checks, sweep):
    clean, corrupted = prompts
    progress_checks.check_cancelled(tiny_arcee, clean, lambda progress: SWEEPS[sweep](tiny_arcee, clean, corrupted,
                                                                                      progress))


def test_attribution_is_exact_where_the_metric_is_linear(tiny_arcee, prompts):
    clean, corrupted = prompts
    # The logits are linear in the final norm's output, and the metric is linear in the logits.
    for direction in ("denoising", "noising"):
        exact = patching.activation_patch(tiny_arcee, clean, corrupted, metric, "final_norm_output",
                                          direction=direction)
        estimate = patching.attribution_patch(tiny_arcee, clean, corrupted, metric, "final_norm_output",
                                              direction=direction)
        assert exact.axes == estimate.axes == ("seq",)
        torch.testing.assert_close(estimate.values, exact.values, rtol=1e-5, atol=1e-5)
        assert exact.effect().abs().max() > 0.05


def test_attribution_tracks_patching_for_small_perturbations(hf_arcee_factory, prompts):
    from hooked_models import HookedArcee

    model = HookedArcee.from_hf(hf_arcee_factory(seed=3)).eval()
    clean = prompts[0].clone()
    clean[:, 2] = 50
    corrupted = clean.clone()
    corrupted[:, 2] = 96
    with torch.no_grad():  # token 96 is token 50 moved by 2%: every patch is a small perturbation
        model.embed_tokens.weight[96] = model.embed_tokens.weight[50] * 1.02
    for value, over in [("layer_input", ("layer", "pos")), ("attention_head_outputs", ("layer", "head")),
                        ("mlp_neurons", ("layer", "neuron"))]:
        exact = patching.activation_patch(model, clean, corrupted, metric, value, over).effect().flatten()
        estimate = patching.attribution_patch(model, clean, corrupted, metric, value, over).effect().flatten()
        big = exact.abs() > 0.1 * exact.abs().max()
        assert torch.equal(torch.sign(estimate[big]), torch.sign(exact[big])), value
        assert torch.corrcoef(torch.stack([exact, estimate]))[0, 1] > 0.99, value
        assert (estimate - exact).abs().max() < 0.05 * exact.abs().max(), value


def test_result_labels_top_and_plot(tiny_arcee, prompts, tmp_path):
    clean, corrupted = prompts
    result = patching.activation_patch(tiny_arcee, clean, corrupted, metric, "resid_pre",
                                       position_labels=[f"t{i}" for i in range(SEQ)])
    assert result.axes == ("layer", "seq")
    assert result.labels == {"layer": ["L0", "L1"], "seq": [f"{i} t{i}" for i in range(SEQ)]}
    (label, value), *_ = result.top(3)
    flat = result.effect().abs().flatten().argmax()
    assert label == result.location(int(flat)) and value == float(result.values.flatten()[flat])
    assert label.split()[0] in ("L0", "L1") and "top" not in str(result)
    fig = result.plot(tmp_path / "resid.png")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "position" and ax.get_ylabel() == "layer"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["L0", "L1"]
    assert (tmp_path / "resid.png").stat().st_size > 5000


def test_sites_and_errors(tiny_arcee, prompts):
    clean, corrupted = prompts
    assert [s.name for s in patching.find_sites(tiny_arcee, "z")] == [
        "layers.0.self_attn.attention_head_outputs", "layers.1.self_attn.attention_head_outputs"]
    assert [s.layer for s in patching.find_sites(tiny_arcee, "blocks.1.hook_resid_pre")] == [1]
    with pytest.raises(ValueError, match="no value 'resid_sideways'"):
        patching.activation_patch(tiny_arcee, clean, corrupted, metric, "resid_sideways")
    with pytest.raises(ValueError, match="over 'num_heads'.*seq, hidden_size"):
        patching.activation_patch(tiny_arcee, clean, corrupted, metric, "layer_input", ("layer", "num_heads"))
    with pytest.raises(ValueError, match="position index 8 is outside"):
        patching.activation_patch(tiny_arcee, clean, corrupted, metric, select={"pos": [8]})
    with pytest.raises(ValueError, match="one shape"):
        patching.activation_patch(tiny_arcee, clean, corrupted[:, :-1], metric)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 7\), but the prompts are \(2, 8\)"):
        patching.activation_patch(tiny_arcee, clean, corrupted, metric,
                                  attention_mask=torch.ones(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="must return a scalar"):
        patching.activation_patch(tiny_arcee, clean, corrupted, lambda logits: logits[:, -1, 0], select={"pos": [0]})
    with pytest.raises(ValueError, match="direction"):
        patching.attribution_patch(tiny_arcee, clean, corrupted, metric, direction="sideways")


# ------------------------------------------------------------------------------------------- alpha-er
@pytest.fixture
def alpha_er(reference_alpha_er_factory):
    from hooked_models import HookedAlphaEr

    return HookedAlphaEr.from_reference(reference_alpha_er_factory(seed=2)).eval()


def test_alpha_er_experts_are_their_windows(alpha_er, prompts):
    clean, corrupted = prompts  # 8 positions over 4 experts: expert g owns positions 2g and 2g+1
    result = patching.activation_patch(alpha_er, clean % 61, corrupted % 61, metric, "mlp_output", ("layer", "expert"))
    assert result.axes == ("layer", "expert") and result.labels["expert"] == ["E0", "E1", "E2", "E3"]
    loop = one_forward_per_patch(alpha_er, corrupted % 61, clean % 61, "mlp_output",
                                 lambda a: [((g,), (slice(2 * g, 2 * g + 2),)) for g in range(4)])
    expected = torch.tensor([[loop[(layer, g)] for g in range(4)] for layer in range(2)])
    torch.testing.assert_close(result.values, expected, rtol=1e-5, atol=1e-6)
    # Expert 0 owns positions before any difference (2 and 5); in the last layer only the expert of the
    # metric's position (the last) reaches the logits.
    unchanged = torch.tensor(result.corrupted_metric)
    assert torch.equal(result.values[0, 0], unchanged) and torch.equal(result.values[1, :3], unchanged.expand(3))
    assert result.values[1, 3] != unchanged


def test_alpha_er_bottlenecks(alpha_er, prompts):
    clean, corrupted = prompts[0] % 61, prompts[1] % 61
    with pytest.raises(ValueError, match="differ in rank.*'lm_head.bottleneck'"):
        patching.activation_patch(alpha_er, clean, corrupted, metric, "bottleneck")
    result = patching.activation_patch(alpha_er, clean, corrupted, metric, "qkv_proj.bottleneck", batch_size=5)
    assert result.axes == ("layer", "rank") and result.values.shape == (2, 7)
    loop = one_forward_per_patch(alpha_er, corrupted, clean, "qkv_proj.bottleneck",
                                 lambda a: [((r,), (slice(None), r)) for r in range(7)])
    expected = torch.tensor([[loop[(layer, r)] for r in range(7)] for layer in range(2)])
    torch.testing.assert_close(result.values, expected, rtol=1e-5, atol=1e-6)
    sites = patching.activation_patch(alpha_er, clean, corrupted, metric, "bottleneck_normed", ("site",),
                                      select={"site": [0, 1, 4]})
    assert sites.labels["site"] == ["L0 qkv_proj", "L0 o_proj", "lm_head"]
    # The logits are linear in the LM head's normed bottleneck: attribution is exact there.
    exact = patching.activation_patch(alpha_er, clean, corrupted, metric, "lm_head.bottleneck_normed")
    estimate = patching.attribution_patch(alpha_er, clean, corrupted, metric, "lm_head.bottleneck_normed")
    assert exact.axes == ("rank",) and exact.effect().abs().max() > 0.01
    torch.testing.assert_close(estimate.values, exact.values, rtol=1e-5, atol=1e-5)
