"""Transcoders as SAELens's `Transcoder`, `SkipTranscoder`, `JumpReLUTranscoder` and
`JumpReLUSkipTranscoder` (the SAE environment): the same function, saved and loaded by SAELens, and
SAELens's own transcoder spliced into both families as ours is. SAELens 6.x trains no transcoders,
so training is the package's (test_transcoders.py)."""

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens", reason="SAELens is not installed (pip install -e '.[sae]')")

from sae_lens import SAE  # noqa: E402

from hooked_models.transcoders import Transcoder, TranscoderSet  # noqa: E402


KINDS = [("relu", False, "Transcoder"), ("relu", True, "SkipTranscoder"), ("jumprelu", False, "JumpReLUTranscoder"),
         ("jumprelu", True, "JumpReLUSkipTranscoder")]


@pytest.mark.parametrize("activation,skip,cls", KINDS)
def test_sae_lens_transcoder_is_the_same_function(tmp_path, activation, skip, cls, random_transcoder_):
    tc = random_transcoder_(Transcoder(8, 32, layer=1, activation=activation, skip=skip))
    sae = tc.to_sae_lens()
    assert type(sae).__name__ == cls
    hooks = (sae.cfg.metadata.hook_name, sae.cfg.metadata.hook_name_out)
    assert hooks == ("layers.1.mlp_input", "layers.1.mlp.mlp_output")
    x = torch.randn(4, 5, 8)
    with torch.no_grad():
        assert torch.equal(sae.encode(x), tc.encode(x))
        assert torch.equal(sae(x), tc(x))
    sae.save_model(str(tmp_path))
    back = Transcoder.from_sae_lens(SAE.load_from_disk(str(tmp_path)))
    assert back.layer == 1 and back.activation == activation and back.has_skip == skip
    for (name, a), b in zip(tc.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_topk_has_no_sae_lens_class():
    with pytest.raises(ValueError, match="SAELens has no topk transcoder"):
        Transcoder(8, 32, activation="topk", k=4).to_sae_lens()


def test_a_set_round_trips_through_sae_lens_files(tmp_path, tl_model, random_transcoder_):
    d = tl_model.cfg.hidden_size
    tcs = TranscoderSet([random_transcoder_(Transcoder(d, 16, layer=l, activation="jumprelu", skip=True), l)
                         for l in range(tl_model.cfg.num_layers)], model=tl_model)
    tcs.save_sae_lens(tmp_path)
    back = TranscoderSet.load_sae_lens(tmp_path, model=tl_model)
    for a, b in zip(tcs.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)


def test_sae_lens_transcoders_splice_as_ours(tl_model, random_transcoder_):
    model = tl_model
    d = model.cfg.hidden_size
    seq = getattr(model.cfg, "block_size", 8)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    ours = [random_transcoder_(Transcoder(d, 16, layer=l, activation="jumprelu", skip=True), l)
            for l in range(model.cfg.num_layers)]
    theirs = [tc.to_sae_lens() for tc in ours]
    with torch.no_grad():
        assert torch.equal(model.run_with_saes(tokens, saes=theirs, use_error_term=True), model(tokens))
        spliced = model.run_with_saes(tokens, saes=theirs, use_error_term=False)
        assert torch.equal(spliced, model.run_with_saes(tokens, saes=ours, use_error_term=False))
    assert not torch.equal(spliced, model(tokens))
