"""The paper's 8-rank layout sweeps (Tables A7/A8 and their colocated counterparts) against their
baselines, through tools/parity.py's engine. About a minute per layout on 2 cores: `-m slow`."""

import glob
import importlib.util
import os

import pytest
import yaml

from mimo.training.parity import parity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEPS = os.path.join(ROOT, "examples", "configs", "sweeps")
LAYOUTS = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(SWEEPS, "a[78]_*.yaml"))
                 if not p.endswith("_baseline.yaml"))


def _raw(name):
    with open(os.path.join(SWEEPS, name + ".yaml")) as f:
        return yaml.safe_load(f)


def _tables():
    spec = importlib.util.spec_from_file_location("make_paper_sweeps", os.path.join(ROOT, "tools",
                                                                                  "make_paper_sweeps.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {"a7": module.A7, "a8": module.A8}


def test_every_sweep_table_is_complete():
    # Every row of the generator's tables, non-colocated and colocated (DP doubled), and nothing else.
    expected = {f"{t}_{row}_{kind}" for t, rows in _tables().items() for row in rows
                for kind in ("noncolocated", "colocated")}
    assert set(LAYOUTS) == expected
    for name in LAYOUTS:
        assert _raw(name)["parallelism"] != _raw(name[:2] + "_baseline")["parallelism"], name


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_sweep_layout_matches_its_baseline(name):
    (report,) = parity(_raw(name[:2] + "_baseline"), [_raw(name)], [name], steps=2, rtol=1e-4)
    assert report["world_size"] == 8
    assert report["ok"], report
