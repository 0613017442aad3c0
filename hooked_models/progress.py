"""The progress bar: tqdm's notebook widget where Jupyter can draw one, its text bar everywhere else.

`tqdm.auto` picks the widget in any Jupyter kernel, and there without ipywidgets it warns
("TqdmWarning: IProgress not found") and falls back to the text bar; asking for the widget only when
ipywidgets is installed gives the same bar without the warning.
"""

import importlib.util

if importlib.util.find_spec("ipywidgets") is not None:
    from tqdm.auto import tqdm
else:
    from tqdm import tqdm

__all__ = ["tqdm"]
