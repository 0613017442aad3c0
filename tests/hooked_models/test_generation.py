"""generate: greedy equal to transformers' token for token, sampling, hooks at every step, errors."""

import pytest
import torch

from hooked_models import HookedArcee
from hooked_models.generation import pick_next_tokens

VOCAB = 97


def left_padded(lengths, seed=1, pad=0):
    """A batch of random prompts of the given lengths, left-padded, and its mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    tokens = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        tokens[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=generator)
        mask[row, width - n:] = 1
    return tokens, mask


def no_hooks_left(model) -> bool:
    return not any(point.fwd_hooks or point.bwd_hooks for point in model.hook_dict.values())


# ------------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_batch_matches_transformers(tiny_arcee, tiny_hf_arcee, use_cache):
    tokens, mask = left_padded([5, 9, 2])
    expected = tiny_hf_arcee.generate(input_ids=tokens, attention_mask=mask, do_sample=False, max_new_tokens=24)
    out = tiny_arcee.generate(tokens, attention_mask=mask, temperature=0, max_new_tokens=24, use_cache=use_cache)
    assert torch.equal(out, expected)


def test_greedy_single_prompt_matches_transformers(tiny_arcee, tiny_hf_arcee):
    prompt = left_padded([7], seed=3)[0][0]
    expected = tiny_hf_arcee.generate(input_ids=prompt[None], do_sample=False, max_new_tokens=24)[0]
    assert torch.equal(tiny_arcee.generate(prompt, do_sample=False, max_new_tokens=24)[0], expected)


def test_right_padded_input_is_left_justified(tiny_arcee):
    tokens, mask = left_padded([5, 9, 2])
    right_tokens = torch.zeros_like(tokens)
    right_mask = torch.zeros_like(mask)
    for row in range(3):
        n = int(mask[row].sum())
        right_tokens[row, :n], right_mask[row, :n] = tokens[row, -n:], 1
    left = tiny_arcee.generate(tokens, attention_mask=mask, temperature=0, max_new_tokens=6)
    right = tiny_arcee.generate(right_tokens, attention_mask=right_mask, temperature=0, max_new_tokens=6)
    assert torch.equal(left, right)


def test_eos_stops_rows_like_transformers(tiny_arcee, tiny_hf_arcee):
    tokens, mask = left_padded([5, 9, 2])
    free = tiny_arcee.generate(tokens, attention_mask=mask, temperature=0, max_new_tokens=24, stop_at_eos=False)
    new = free[:, tokens.shape[1]:]
    # An EOS that every row produces, at different steps: rows finish apart, then the whole batch.
    common = set(new[0].tolist()) & set(new[1].tolist()) & set(new[2].tolist())
    eos = max(common, key=lambda t: min(int((row == t).nonzero()[0]) for row in new))
    expected = tiny_hf_arcee.generate(input_ids=tokens, attention_mask=mask, do_sample=False, max_new_tokens=24,
                                      eos_token_id=eos, pad_token_id=0)
    out = tiny_arcee.generate(tokens, attention_mask=mask, temperature=0, max_new_tokens=24, eos_token_id=eos)
    assert out.shape[1] < free.shape[1]
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------------- sampling
def test_sampling_is_reproducible_from_a_seed(tiny_arcee):
    tokens, mask = left_padded([5, 9])
    kwargs = dict(attention_mask=mask, max_new_tokens=16, temperature=1.5, top_k=20, top_p=0.95)
    first = tiny_arcee.generate(tokens, seed=7, **kwargs)
    assert torch.equal(first, tiny_arcee.generate(tokens, seed=7, **kwargs))
    assert not torch.equal(first, tiny_arcee.generate(tokens, seed=8, **kwargs))
    torch.manual_seed(7)  # without a seed, the global stream
    assert torch.equal(first, tiny_arcee.generate(tokens, **kwargs))


def test_narrow_sampling_is_greedy(tiny_arcee):
    tokens, mask = left_padded([5, 9])
    greedy = tiny_arcee.generate(tokens, attention_mask=mask, temperature=0, max_new_tokens=10)
    for narrow in (dict(top_k=1), dict(top_p=1e-6)):
        out = tiny_arcee.generate(tokens, attention_mask=mask, temperature=2.0, max_new_tokens=10, seed=0, **narrow)
        assert torch.equal(out, greedy)


def test_draws_follow_the_truncated_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    draws = 20000
    picked = pick_next_tokens(logits.expand(draws, -1), temperature=2.0, top_k=4,
                              generator=torch.Generator().manual_seed(0))
    top = logits.topk(4).indices
    expected = torch.zeros(6).index_put_((top,), torch.softmax(logits[top] / 2.0, -1))
    frequency = torch.bincount(picked, minlength=6).float() / draws
    torch.testing.assert_close(frequency, expected, atol=0.015, rtol=0)
    # Nucleus: with probabilities p sorted, the kept prefix is the first whose mass reaches top_p.
    p = torch.softmax(logits, -1).sort(descending=True)
    picked = pick_next_tokens(logits.expand(draws, -1), 1.0, top_p=float(p.values[:2].sum()) - 1e-3,
                              generator=torch.Generator().manual_seed(0))
    assert set(picked.tolist()) == set(p.indices[:2].tolist())


# ------------------------------------------------------------------------------------- hooks
def test_steering_hook_forces_a_token(tiny_arcee):
    tokens, mask = left_padded([5, 9])
    target = 42
    direction = tiny_arcee.lm_head.weight[target].detach()

    def steer(x, hook):
        return x + 20 * direction

    plain = tiny_arcee.generate(tokens, attention_mask=mask, temperature=0, max_new_tokens=8)
    assert not bool((plain[:, tokens.shape[1]:] == target).all())
    steered = tiny_arcee.generate(tokens, attention_mask=mask, temperature=0, max_new_tokens=8,
                                  fwd_hooks=[("final_norm_output", steer)])
    assert bool((steered[:, tokens.shape[1]:] == target).all())
    with tiny_arcee.hooks(fwd_hooks=[("ln_final.hook_normalized", lambda x, hook: None)]):
        pass  # a TransformerLens name resolves too (and leaves nothing behind)
    with tiny_arcee.hooks(fwd_hooks=[("final_norm_output", steer)]):
        assert torch.equal(tiny_arcee.generate(tokens, attention_mask=mask, temperature=0, max_new_tokens=8), steered)
    assert no_hooks_left(tiny_arcee)


def test_hooks_see_real_positions_with_and_without_cache(tiny_arcee):
    tokens, mask = left_padded([5, 9])
    width = tokens.shape[1]
    direction = torch.randn(tiny_arcee.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    results, shapes = {}, {}
    for use_cache in (True, False):
        seen = shapes[use_cache] = []
        fwd_hooks = [("blocks.0.hook_resid_post", lambda x, hook: x + 0.5 * direction),
                     ("layers.1.self_attn.attention_probabilities", lambda p, hook: seen.append(tuple(p.shape))),
                     ("logits", lambda x, hook: seen.append(tuple(x.shape)))]
        results[use_cache] = tiny_arcee.generate(tokens, attention_mask=mask, temperature=0, max_new_tokens=5,
                                                 use_cache=use_cache, fwd_hooks=fwd_hooks)
    heads = tiny_arcee.cfg.num_heads
    # With the cache a step sees its new query over every key so far, and the logits of the last
    # position only (the prompt's others are never computed); without, the whole sequence.
    vocab = tiny_arcee.cfg.vocab_size
    assert shapes[True] == [(2, heads, width, width), (2, 1, vocab)] + [
        shape for i in range(1, 5) for shape in ((2, heads, 1, width + i), (2, 1, vocab))]
    assert shapes[False] == [shape for i in range(5) for shape in ((2, heads, width + i, width + i),
                                                                   (2, width + i, vocab))]
    assert torch.equal(results[True], results[False])
    unsteered = tiny_arcee.generate(tokens, attention_mask=mask, temperature=0, max_new_tokens=5)
    assert not torch.equal(results[True], unsteered)


def test_no_hooks_left_when_a_hook_raises(tiny_arcee):
    calls = []

    def fails_on_third_step(x, hook):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        tiny_arcee.generate(left_padded([4])[0], max_new_tokens=5, fwd_hooks=[("logits", fails_on_third_step)])
    assert no_hooks_left(tiny_arcee)


# ------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=0), "top_k must be an integer >= 1"),
    (dict(return_type="logits"), "return_type must be one of"),
])
def test_bad_arguments(tiny_arcee, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_arcee.generate(left_padded([4])[0], **{"max_new_tokens": 3, **kwargs})


def test_prompt_longer_than_the_model_allows(tiny_arcee):
    limit = tiny_arcee.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=f"the prompt is {limit + 1} tokens, longer than the {limit} positions"):
        tiny_arcee.generate(torch.ones(1, limit + 1, dtype=torch.long), max_new_tokens=1)
    with pytest.raises(ValueError, match=f"use max_new_tokens <= 6"):
        tiny_arcee.generate(torch.ones(1, limit - 6, dtype=torch.long), max_new_tokens=10)


def test_zero_new_tokens_returns_the_prompt(tiny_arcee):
    prompt = left_padded([4])[0]
    assert torch.equal(tiny_arcee.generate(prompt, max_new_tokens=0), prompt)


def test_progress_bar_only_when_asked_or_interactive(tiny_arcee, capsys):
    prompt = left_padded([4])[0]
    tiny_arcee.generate(prompt, max_new_tokens=3, verbose=True)
    assert "generate" in capsys.readouterr().err
    tiny_arcee.generate(prompt, max_new_tokens=3)  # pytest's stderr is no terminal
    tiny_arcee.generate(prompt, max_new_tokens=3, verbose=False)
    assert capsys.readouterr().err == ""


# -------------------------------------------------------------------------------- text, chat
CHATML = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory, tiny_hf_arcee):
    """A checkpoint directory with a word-level tokenizer and a ChatML template with a default system turn."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>"]
    words = "system user assistant You are a helpful assistant. hello world the cat sat on".split()
    names = special + words + [f"w{i}" for i in range(VOCAB - len(special) - len(words))]
    backend = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(special)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>",
                                        pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = CHATML
    directory = tmp_path_factory.mktemp("chat_arcee")
    tiny_hf_arcee.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, tokenizer


def test_text_in_text_out(chat_checkpoint, tiny_hf_arcee):
    directory, tokenizer = chat_checkpoint
    model = HookedArcee.from_pretrained(str(directory))
    prompts = ["hello world the", "cat"]
    texts = model.generate(prompts, temperature=0, max_new_tokens=6)
    assert isinstance(texts, list)
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    tokens, mask = model.to_tokens(prompts, padding_side="left", return_mask=True)
    expected = tiny_hf_arcee.generate(input_ids=tokens, attention_mask=mask, do_sample=False, max_new_tokens=6,
                                      eos_token_id=[2, tokenizer.eos_token_id], pad_token_id=0)
    for text, prompt, ids, row in zip(texts, prompts, encoded, expected):
        new = row[tokens.shape[1]:].tolist()
        assert text == prompt + tokenizer.decode([tokenizer.bos_token_id, *ids, *new],
                                                 skip_special_tokens=True)[len(prompt):]
    assert model.generate(prompts[0], temperature=0, max_new_tokens=6) == texts[0]


def test_chat_uses_the_checkpoint_template(chat_checkpoint, tiny_hf_arcee):
    directory, tokenizer = chat_checkpoint
    model = HookedArcee.from_pretrained(str(directory))
    messages = [{"role": "user", "content": "hello world"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert model.apply_chat_template("hello world") == [rendered]
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.")  # the default system turn
    ids = torch.tensor([tokenizer(rendered, add_special_tokens=False)["input_ids"]])
    expected = tiny_hf_arcee.generate(input_ids=ids, do_sample=False, max_new_tokens=6,
                                      eos_token_id=[2, tokenizer.eos_token_id])
    out = model.generate("hello world", chat=True, temperature=0, max_new_tokens=6, return_type="tokens")
    assert torch.equal(out, expected)
    assert model.generate(messages, chat=True, temperature=0, max_new_tokens=6).startswith(rendered)


def test_chat_without_a_template(tiny_arcee):
    with pytest.raises(ValueError, match="no tokenizer|no chat template"):
        tiny_arcee.generate("hello", chat=True)


# ---------------------------------------------------------------------------------- alpha-er
@pytest.fixture
def alpha_er(reference_alpha_er_factory):
    from hooked_models import HookedAlphaEr

    reference = reference_alpha_er_factory(seed=2)
    return reference, HookedAlphaEr.from_reference(reference)


def alpha_er_prompt(model, length, seed=0):
    return torch.randint(1, model.cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


# Sliding windows and top_k draws: tests/hooked_models/families/test_alpha_er.py; here what generate adds.
@pytest.mark.parametrize("length, settings", [
    (40, dict(temperature=0)),                # a prompt longer than block_size 32: its last 32 tokens
    (3, dict(temperature=0.8, top_k=5)),      # a seed gives the draws of the global stream seeded alike
])
def test_alpha_er_follows_the_reference(alpha_er, length, settings):
    reference, model = alpha_er
    prompt = alpha_er_prompt(model, length, seed=length)
    torch.manual_seed(7)
    expected = reference.generate(prompt, max_new_tokens=40, **settings)
    torch.manual_seed(7)
    assert torch.equal(model.generate(prompt, max_new_tokens=40, **settings), expected)
    if settings["temperature"]:  # the same draws from a seed as from the global stream seeded alike
        assert torch.equal(model.generate(prompt, max_new_tokens=40, seed=7, **settings), expected)


def test_alpha_er_batch_equals_each_prompt(alpha_er):
    _, model = alpha_er
    prompts = [alpha_er_prompt(model, n, seed=n)[0] for n in (3, 11, 36)]
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)], mask[row, : len(p)] = p, 1  # right-padded: generate left-justifies
    batch = model.generate(tokens, attention_mask=mask, temperature=0, max_new_tokens=8)
    for row, p in enumerate(prompts):
        alone = model.generate(p, temperature=0, max_new_tokens=8)[0]
        assert torch.equal(batch[row, width - len(p):], alone)  # the batch comes back left-padded


def test_alpha_er_hooks_see_the_padded_window(alpha_er):
    _, model = alpha_er
    seen = []
    hook = ("blocks.0.hook_resid_pre", lambda x, hook: seen.append(tuple(x.shape)))
    model.generate(alpha_er_prompt(model, 4), temperature=0, max_new_tokens=3, fwd_hooks=[hook])
    assert seen == [(1, model.cfg.block_size, model.cfg.n_embd)] * 3
    assert no_hooks_left(model)


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_unknown_words_are_named_not_silently_unk(family):
    """The embedded tokenizer is word-level: a word outside its vocabulary becomes <unk>, and generate
    returns the prompt as given, so only a warning, naming the words and pointing at the caller's line,
    shows it. Known words warn nothing."""
    import warnings

    from hooked_models import HookedAlphaEr

    model = (HookedArcee if family == "arcee" else HookedAlphaEr).from_pretrained("embedded")
    prompt = "When Zorblax and John went to the store together, John gave a drink to"
    with pytest.warns(UserWarning) as caught:
        text = model.generate(prompt, max_new_tokens=1, temperature=0)
    assert text.startswith(prompt)
    [warning] = caught
    assert str(warning.message) == ("' Zorblax' is not in the tokenizer's vocabulary: the model reads '<unk>' "
                                    f"(id {model.tokenizer.unk_token_id}) in its place")
    assert warning.filename == __file__
    with pytest.warns(UserWarning, match=r"^' Quux', ' Zorblax' are not in the tokenizer's vocabulary") as caught:
        model.run_with_cache(["When Quux and", " Zorblax"])
    with pytest.warns(UserWarning, match=r"^' Quux' is not") as called:
        model("When Quux and")                                   # through TransformerLens's __call__
    assert caught[0].filename == called[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(prompt.replace("Zorblax", "Mary"), max_new_tokens=1, temperature=0)
        model.to_tokens("<unk>")   # the unknown token written out is not an unknown word
