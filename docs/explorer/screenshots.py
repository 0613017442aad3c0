"""Regenerate the README's explorer screenshots (docs/explorer/*.png): the browser tests take them while
they check each view, on the embedded Arcee model, into this folder.

    python docs/explorer/screenshots.py
"""

import os
import subprocess
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
root = here.parents[1]
env = {**os.environ, "EXPLORER_SCREENSHOTS": str(here), "PYTHONPATH": str(root)}
sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", "tests/hooked_models/explorer/test_browser.py"],
                         cwd=root, env=env))
