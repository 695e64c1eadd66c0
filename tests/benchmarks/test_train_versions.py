"""benchmarks/train_versions.py: `make adapters` rebuilds the committed target versions with their
own settings (the script's defaults are their build.json's), and a build records its data."""

from __future__ import annotations

import json
import random
import sys

import pytest

from benchmarks.train_versions import DATA, OUT, data_provenance, parser


@pytest.mark.parametrize("version", sorted(DATA))
def test_defaults_are_the_committed_artifacts_settings(version):
    built = json.loads((OUT / version / "build.json").read_text())
    a = parser().parse_args([])
    assert (a.steps, a.batch, a.max_len, a.lr, a.seed) == (built["steps"], built["batch"], built["max_len"],
                                                            built["lr"], built["seed"])
    assert version in a.versions and a.out == OUT


@pytest.mark.parametrize("version", sorted(DATA))
def test_a_build_records_its_data(version):
    used: set[str] = set()
    examples = DATA[version](random.Random(0), 12, used=used)
    info = data_provenance(version, used, examples)
    assert info["python"] == ".".join(map(str, sys.version_info[:3]))
    assert info["libraries"]["torch"] and info["libraries"]["peft"]
    assert info["drawn_sources"] and set(info["drawn_sources"]) <= set(info["pool_sources"])
    # the same seed draws the same text; another seed other text
    assert info["examples_sha256"] == data_provenance(version, set(), DATA[version](random.Random(0), 12))[
        "examples_sha256"]
    assert info["examples_sha256"] != data_provenance(version, set(), DATA[version](random.Random(1), 12))[
        "examples_sha256"]
    held = set()
    DATA[version](random.Random(0), 12, held_out=True, used=held)
    assert not held & set(info["pool_sources"])  # held-out sources are never in the training pool
