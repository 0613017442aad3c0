"""The explorer's features view on an SAE SAELens saved (the SAE environment: SAELens 6.x, TransformerLens 3.x):
`--sae DIR` loads it through SAELens, and its dashboard is `features.dashboard`'s."""

import pytest
import torch

pytest.importorskip("sae_lens")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:sae_lens")

from fastapi.testclient import TestClient  # noqa: E402
from sae_lens import StandardSAE, StandardSAEConfig  # noqa: E402
from sae_lens.saes.sae import SAEMetadata  # noqa: E402

from hooked_models import features  # noqa: E402
from hooked_models.explorer import create_app  # noqa: E402
from hooked_models.explorer.server import load_sae  # noqa: E402

from .test_server import wait  # noqa: E402


def test_a_sae_lens_sae_saved_to_disk_opens_in_the_features_view(arcee, data_dir, tmp_path):
    torch.manual_seed(0)
    sae = StandardSAE(StandardSAEConfig(d_in=64, d_sae=16, metadata=SAEMetadata(hook_name="blocks.1.hook_resid_post")))
    with torch.no_grad():
        sae.b_enc.normal_(0, 0.2)
        sae.b_dec.normal_(0, 0.2)
    sae.save_model(str(tmp_path / "sae"))
    loaded = load_sae(tmp_path / "sae", arcee)
    assert type(loaded) is StandardSAE and torch.equal(loaded.W_enc, sae.W_enc)
    client = TestClient(create_app(arcee, [data_dir], {"sae": loaded}))
    status = wait(client, client.post("/api/features/dashboard", json={"harvest": "acts", "sae": "sae", "feature": 4}).json())
    assert status["state"] == "done", status["error"]
    board = features.dashboard(arcee, data_dir / "acts", sae, 4)
    assert status["result"]["max_activation"] == board.max_activation and status["result"]["counts"] == board.counts
    assert status["result"]["name"] == "layers.1.layer_output" and status["result"]["windows"]
    with pytest.raises(ValueError, match="neither a transcoder set"):
        load_sae(tmp_path, arcee)
