"""`attribute_dataset` on Ray: 2 workers on a local cluster (2 CPUs, actors of fractional CPUs, as the corpus
tests run it), each loading the embedded model and transcoders from their paths, write the store the local
engine writes, byte for byte (every graph file, its tensors, the index)."""

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("datasets")

from hooked_models.attribution import attribute_dataset  # noqa: E402
from hooked_models.embedded.task import build_tokenizer, make_ioi_prompts  # noqa: E402

from ..test_corpus_ray import ray_cluster  # noqa: E402,F401
from .test_dataset import files  # noqa: E402


def test_ray_with_two_workers_writes_the_local_store(ray_cluster, tmp_path):  # noqa: F811
    ioi = make_ioi_prompts(4, seed=5, tokenizer=build_tokenizer(), templates=(1,))
    options = dict(head_loadings="pruned", qk=2, max_feature_nodes=64, progress=False)
    local = attribute_dataset("embedded", ioi, "embedded", tmp_path / "local", **options)
    there = attribute_dataset("embedded", ioi, "embedded", tmp_path / "ray", engine="ray", num_workers=2, **options)
    assert files(there.path) == files(local.path) and len(there) == 4
