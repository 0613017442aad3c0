"""The streaming source: batches mix many contexts, memory is the buffer's whatever the dataset's size, a
resumed stream continues exactly, and a dataset too small for one batch is refused."""

import pytest
import torch

from hooked_models.embedded.task import make_ioi_prompts
from hooked_models.transcoders import StreamingSource


def source(model, tokens, buffer_tokens=1024, **kw):
    options = dict(batch_tokens=64, buffer_tokens=buffer_tokens, forward_batch=8, streams=1, share=(0, 1), seed=0)
    return StreamingSource(model, tokens, [0, 1], **{**options, **kw})


class Tagged(StreamingSource):
    """The model's activations with the first entry of each token's replaced by its window's index in the
    dataset, so a batch says which windows it mixes."""

    def activations(self, tokens):
        acts = super().activations(tokens)
        ids = torch.tensor([self.rows.index(row) for row in tokens.tolist()], dtype=acts.dtype)
        acts[..., 0] = ids.repeat_interleave(tokens.shape[1])[:, None, None]
        return acts


def windows_of(stream) -> set[int]:
    return set(stream.batch()[0][0, :, 0].long().tolist())


def test_each_batch_mixes_many_contexts_and_in_order_batches_do_not(arcee):
    tokens = torch.randint(1, arcee.cfg.vocab_size, (256, 16), generator=torch.Generator().manual_seed(0))
    Tagged.rows = tokens.tolist()
    mixed = Tagged(arcee, tokens, [0, 1], batch_tokens=64, buffer_tokens=1024, forward_batch=8, streams=1,
                   share=(0, 1), seed=0)
    counts = [len(windows_of(mixed)) for _ in range(8)]
    assert min(counts) >= 24, counts  # of the 64 windows a 1,024-token buffer holds (in order: 4)
    in_order = Tagged(arcee, tokens, [0, 1], batch_tokens=64, buffer_tokens=0, forward_batch=8, streams=1,
                      share=(0, 1), seed=0)
    assert [windows_of(in_order) for _ in range(3)] == [{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}]


def held_bytes(stream) -> int:
    return sum(t.numel() * t.element_size() for s in stream.mine for t in (s.buffer, s.ready) if t is not None)


def test_memory_is_the_buffers_when_the_dataset_grows_tenfold(arcee):
    """The most the source holds over 40 batches (its buffer and what is ready), and the windows it has run
    through the model, are the same for 256 and 2,560 windows."""
    measured = []
    for n in (256, 2560):
        stream = source(arcee, make_ioi_prompts(n, 7).clean_tokens)
        peak = 0
        for _ in range(40):
            stream.batch()
            peak = max(peak, held_bytes(stream))
        measured.append((peak, stream.mine[0].windows))
    assert measured[0] == measured[1], measured
    buffer_bytes = 1024 * 2 * 2 * 64 * 4  # tokens x (in, out) x layers x hidden_size x float32
    assert measured[0][0] <= 1.5 * buffer_bytes + 8 * 16 * 2 * 2 * 64 * 4


def test_a_resumed_stream_continues_exactly(arcee):
    tokens = make_ioi_prompts(64, 7).clean_tokens  # 1,024 tokens: the run below wraps into a second epoch
    whole = source(arcee, tokens, buffer_tokens=256, seed=3)
    expected = [whole.batch() for _ in range(30)]
    first = source(arcee, tokens, buffer_tokens=256, seed=3)
    for _ in range(11):
        first.batch()
    state = first.state()
    resumed = source(arcee, tokens, buffer_tokens=256, seed=3)
    resumed.load_state(state)
    assert resumed.mine[0].epoch == 0 and whole.mine[0].epoch >= 1
    for x, y in expected[11:]:
        got = resumed.batch()
        assert torch.equal(got[0], x) and torch.equal(got[1], y)


def test_streams_split_the_data_as_processes_would(arcee):
    """Two streams in one process give the batch two processes (one stream each) give together."""
    tokens = make_ioi_prompts(128, 7).clean_tokens
    both = source(arcee, tokens, streams=2)
    parts = [source(arcee, tokens, streams=2, share=(i, 2)) for i in range(2)]
    for _ in range(3):
        x, y = both.batch()
        shares = [p.batch() for p in parts]
        assert torch.equal(x, torch.cat([s[0] for s in shares], dim=1))
        assert torch.equal(y, torch.cat([s[1] for s in shares], dim=1))


def test_bad_sources_are_one_line_errors(arcee):
    tokens = make_ioi_prompts(2, 7).clean_tokens  # 32 tokens
    with pytest.raises(ValueError, match="the dataset is too small for one batch: stream 0 of 1 has 2 windows of "
                                         "16 tokens, and a batch needs 64 tokens"):
        source(arcee, tokens).batch()
    tokens = make_ioi_prompts(64, 7).clean_tokens
    with pytest.raises(ValueError, match="buffer_tokens=100 must hold at least two batches"):
        source(arcee, tokens, buffer_tokens=100)
    with pytest.raises(ValueError, match="streams=3 do not divide among 2 processes"):
        source(arcee, tokens, streams=3, share=(0, 2), batch_tokens=66)
