"""scripts/mutation_check.py stays runnable: every mutant's line is in its file exactly once (a
change to the code that moves it makes this fail here, not silently in the script), each mutant
changes its line, and there are at least twelve across the op's reference, its torch path, the
kernel and the loop."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _mutants():
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.MUTANTS


def test_every_mutant_names_a_line_that_is_there():
    mutants = _mutants()
    assert len(mutants) >= 12 and len({m[0] for m in mutants}) == len(mutants)
    assert {"reference", "torch path", "kernel", "loop"} <= {m[1] for m in mutants}
    for name, _, file, old, new, what in mutants:
        text = (ROOT / file).read_text()
        assert text.count(old) == 1, f"{name}: its line is in {file} {text.count(old)} times, not once"
        assert new != old and what
