#!/usr/bin/env bash
# The side environment of benchmarks/transcoder_training.py: EleutherAI's sparsify 1.3.3 (PyPI `eai-sparsify`) and
# what its Python API path imports (its trainer reads the model's activations through transformers and a
# `datasets.Dataset`; schedulefree for its default Signum optimizer; simple-parsing for its configs). Not built
# or used by .ci/run: only that benchmark's sparsify half runs here, and it imports nothing of this package.
# torch first, pinned to the CPU wheel on disk: sparsify's unpinned `torch` would otherwise pull a CUDA build.
# transformers as the main environment's, so both halves run the same ArceeForCausalLM (sparsify pins none).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m venv .ci/sparsify-env
.ci/sparsify-env/bin/python -m pip install -q "torch==2.13.0"
.ci/sparsify-env/bin/python -m pip install -q "torch==2.13.0" "transformers==5.24.0" "eai-sparsify==1.3.3"
