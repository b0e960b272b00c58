"""Typed stage records (``ditbook.records``): written from the dataclass, read back through it; a
file of another schema version, an unknown field or a missing one is a named error; the schema part
of docs/CONTRACTS.md is generated from the classes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from records_fixtures import bench_record, cache_record, config_row, holdout_row

from ditbook.card import load_card
from ditbook.records import (RECORDS, IntakeResults, RecordError, SchemaVersionError, decode, schema_markdown)
from ditbook.runs import RunFolder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def run(tmp_path):
    return RunFolder.create(load_card(ROOT / "models" / "reference.yaml"), tmp_path / "outputs", "r1")


def test_records_round_trip_through_the_run_folder(run):
    cache = cache_record([holdout_row("dbcache", {"threshold": 0.1}, 33.0, 0.95, 0.4)],
                         chosen=holdout_row("dbcache", {"threshold": 0.1}, 33.0, 0.95, 0.4))
    bench = bench_record([config_row("dbcache[threshold=0.1]", 1.8)])
    for stage, record in (("cache", cache), ("benchmark", bench)):
        run.write_results(stage, record)
        back = run.read_results(stage)
        assert type(back) is RECORDS[stage] and back.to_dict() == record.to_dict()
    data = json.loads(run.results_path("cache").read_text())
    assert data["schema"] == {"stage": "cache", "version": RECORDS["cache"].VERSION}
    assert run.read_results("cache").chosen.holdout_quality.psnr_min == 33.0  # typed all the way down


def test_a_stage_writes_its_own_record_only(run):
    with pytest.raises(TypeError, match="stage 'intake' writes a IntakeResults, not a dict"):
        run.write_results("intake", {"images": []})
    with pytest.raises(TypeError, match="not a CacheResults"):
        run.write_results("intake", cache_record())


def test_another_schema_version_is_a_named_error_naming_both(run):
    run.write_results("intake", IntakeResults(images=[], placement={"device": "cpu"}))
    path = run.results_path("intake")
    data = json.loads(path.read_text())
    data["schema"]["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaVersionError, match=r"schema version intake 99; this ditbook reads intake version 1"):
        run.read_results("intake")
    del data["schema"]  # a run folder from before the records
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaVersionError, match="written before stage records had a schema"):
        run.read_results("intake")


def test_unknown_missing_and_misshapen_fields_are_refused_by_name():
    good = {"schema": {"stage": "intake", "version": 1}, "images": [], "placement": {}}
    IntakeResults.from_dict(good)
    with pytest.raises(RecordError, match=r"unknown field\(s\) \['tuned'\]"):  # no alias names
        IntakeResults.from_dict({**good, "tuned": []})
    with pytest.raises(RecordError, match=r"intake/results.json.images: missing"):
        IntakeResults.from_dict({k: v for k, v in good.items() if k != "images"})
    with pytest.raises(RecordError, match=r"images\[0\]: expected a mapping for ImageRow"):
        IntakeResults.from_dict({**good, "images": ["p0_s0.png"]})
    with pytest.raises(RecordError, match=r"images\[0\].key: missing"):
        decode(IntakeResults, {"images": [{"prompt": "a", "seed": 0, "png": "a", "npy": "a"}], "placement": {}}, "r")


def test_the_contracts_schema_part_is_generated_from_the_records():
    text = (ROOT / "docs" / "CONTRACTS.md").read_text()
    m = re.search(r"<!-- records: python -m ditbook.records -->\n(.*?)\n<!-- /records -->", text, re.S)
    assert m, "docs/CONTRACTS.md lost its generated records block"
    assert m.group(1) == schema_markdown(), "CONTRACTS.md's schema differs from ditbook.records: paste python -m ditbook.records"
