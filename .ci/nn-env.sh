#!/usr/bin/env bash
# The side environment of the nnsight and nnterp tests (tests/hooked_models/alpha_er_transformers/test_nnterp.py):
# nnterp 1.3.0 imports `nnsight.intervention.tracing`, which nnsight 0.7+ moved, so nnsight is held at 0.6.3;
# transformers 5.24 as in the main environment. hooked_models is not installed: the tests put the worktree on
# PYTHONPATH for the RenameConfig (hooked_models/alpha_er_transformers/nnterp_config.py). About 40 s.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m venv .ci/nn-env
.ci/nn-env/bin/python -m pip install -q "torch==2.13.0"
.ci/nn-env/bin/python -m pip install -q "transformers==5.24.0" "nnsight==0.6.3" "nnterp==1.3.0"
