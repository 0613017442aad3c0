import torch


def test_logits_match_transformers(tiny_arcee, tiny_hf_arcee):
    tokens = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(tiny_arcee(tokens), tiny_hf_arcee(tokens).logits, rtol=1e-5, atol=1e-5)
