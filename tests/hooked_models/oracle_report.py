"""Print the oracle table: per value, the oracle used and the measured max |difference| read and written.

    PYTHONPATH=. python tests/hooked_models/oracle_report.py

Builds the same tiny random pairs as tests/hooked_models/test_oracles.py (conftest's builders, seed 4), reads
every value and writes it under every name, and prints one row per value: the read difference (max over
layers), the write difference in the logits (max over the standard and TransformerLens names), and whether
the table demands bit-for-bit equality or a bound (relative to the reference's scale).
"""

import importlib.util
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path[:0] = [str(HERE), str(TESTS / "reference")]
torch.set_num_threads(1)

import oracles  # noqa: E402


def _conftest():
    spec = importlib.util.spec_from_file_location("tests_conftest", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scaled(diff: float, reference: torch.Tensor) -> float:
    """|diff| relative to max |reference| over its finite entries, as the table's bounds are."""
    return diff / float(reference[torch.isfinite(reference)].abs().max())


def measure(pair: "oracles.Pair", key: str) -> tuple[float, float, float | None, float | None, int]:
    """(max read |diff|, relative; max write |diff| in the logits, relative, or None for a read-only
    value; how many names were written)."""
    reads = [(oracles.max_diff(h, r), scaled(oracles.max_diff(h, r), r)) for _, h, r in pair.read(key)]
    read, read_rel = max(d for d, _ in reads), max(r for _, r in reads)
    if pair.table[key].read_only:
        return read, read_rel, None, None, len(pair.names_of(key))
    hooked, reference, _, keep = pair.write(key)
    write = max(oracles.max_diff(logits[keep], reference[keep]) for logits in hooked.values())
    return read, read_rel, write, scaled(write, reference[keep]), len(hooked)


def main() -> None:
    conftest = _conftest()
    pairs = oracles.make_pairs(conftest.make_hf_arcee(seed=4), conftest.make_reference_alpha_er(seed=4))
    width = max(len(key) for table in oracles.ORACLES.values() for key in table)
    header = f"{'family':<9} {'value':<{width}}  {'read':>9}  {'write':>9}  {'names':>5}  {'demanded':<32} oracle"
    print(header)
    print("-" * len(header))
    for family, pair in pairs.items():
        for key, oracle in pair.table.items():
            read, read_rel, write, write_rel, names = measure(pair, key)
            if oracle.read_bound or oracle.write_bound:
                measured = f"{read_rel:.1e}/{0.0 if write_rel is None else write_rel:.1e}"
                demanded = f"rel {measured} <= {oracle.read_bound:g}/{oracle.write_bound:g}"
            else:
                demanded = "bit for bit"
            written = "read-only" if write is None else f"{write:9.2e}"
            print(f"{family:<9} {key:<{width}}  {read:9.2e}  {written:>9}  {names:>5}  {demanded:<32} {oracle.source}")
            if oracle.why:
                print(f"{'':<9} {'':<{width}}  {'':>9}  {'':>9}  {'':>5}  {'':<32} (bound: {oracle.why})")


if __name__ == "__main__":
    main()
