#!/usr/bin/env bash
# The side environment of benchmarks/circuit_tracer_compare.py: circuit-tracer 0.5.0 beside transformers 4.57
# (its nnsight backend needs transformers <= 4.57.3; this package needs >= 5, so they never share one).
# Only what its nnsight path imports: circuit-tracer without its dependencies (TransformerLens 2-3, datasets,
# ... are for its other backend), nnsight 0.6 (0.7+ moved `nnsight.intervention.tracing`, which 0.5.0 imports).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m venv .ci/ct-env
.ci/ct-env/bin/python -m pip install -q "torch==2.13.0"
.ci/ct-env/bin/python -m pip install -q "transformers==4.57.3" "nnsight==0.6.3" einops pydantic pyyaml
.ci/ct-env/bin/python -m pip install -q --no-deps "circuit-tracer==0.5.0"
