#!/usr/bin/env bash
# Refreshes the scripts circuit-tracer's viewer loads from CDNs, which the package ships in
# hooked_models/features/viewer_static/vendor (hooked_models/features/viewer.py serves them; its README says
# which stands for which): d3 v7 and d3-jetpack with d3-collection (whose `nest` its nestBy needs) for
# transformer-circuits.pub's d3 and jetpack builds, dagre and pako from theirs, each with its license.
# Not run by CI: the copies are committed, so serving the viewer and its tests fetch nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
npm install -q --no-save --no-audit --no-fund --prefix .ci/viewer-libs d3@7.9.0 d3-collection@1.0.7 d3-jetpack@2.1.0 dagre@0.8.5 pako@2.1.0
from=.ci/viewer-libs/node_modules
to=hooked_models/features/viewer_static/vendor
cp "$from/d3/dist/d3.min.js" "$to/d3-7.9.0.min.js"; cp "$from/d3/LICENSE" "$to/LICENSE-d3.txt"
cp "$from/dagre/dist/dagre.min.js" "$to/dagre-0.8.5.min.js"; cp "$from/dagre/LICENSE" "$to/LICENSE-dagre.txt"
cp "$from/pako/dist/pako.min.js" "$to/pako-2.1.0.min.js"; cp "$from/pako/LICENSE" "$to/LICENSE-pako.txt"
cp "$from/d3-jetpack/build/d3-jetpack.js" "$to/d3-jetpack-2.1.0.js"; cp "$from/d3-jetpack/LICENSE" "$to/LICENSE-d3-jetpack.txt"
cp "$from/d3-collection/dist/d3-collection.min.js" "$to/d3-collection-1.0.7.min.js"
cp "$from/d3-collection/LICENSE" "$to/LICENSE-d3-collection.txt"
