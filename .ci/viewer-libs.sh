#!/usr/bin/env bash
# The scripts circuit-tracer's local viewer loads from CDNs, from their npm packages, into .ci/viewer-libs
# (ignored by git): tests/hooked_models/features/test_circuit_tracer_viewer.py routes the viewer's requests
# to them: d3 v7 and d3-jetpack (whose UMD build adds the helpers the viewer calls on d3's selections:
# append("div.class"), appendMany, st, at; its nestBy needs d3-collection's nest, gone from d3 v7) for
# transformer-circuits.pub's d3 and jetpack builds; dagre and pako
# from theirs. The viewer's npy reader and hot-reload client have no package: the test stubs them.
set -euo pipefail
cd "$(dirname "$0")/.."
npm install -q --no-save --no-audit --no-fund --prefix .ci/viewer-libs d3@7.9.0 d3-collection@1.0.7 d3-jetpack@2.1.0 dagre@0.8.5 pako@2.1.0
