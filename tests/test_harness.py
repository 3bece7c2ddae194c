"""The suite's own machinery: the order files are handed to xdist's processes (conftest's
longest_files_first over tests/seconds.json, written by tests/seconds_table.py). Pure logic."""

from __future__ import annotations

import dataclasses
import json

import conftest
import seconds_table


@dataclasses.dataclass
class Item:
    nodeid: str


def test_the_files_go_longest_first_an_unmeasured_one_before_all_and_each_keeps_its_order(tmp_path, monkeypatch):
    table = tmp_path / "seconds.json"
    table.write_text(json.dumps({"tests/test_a.py::x": 3.0, "tests/test_a.py::y": 2.0, "tests/test_b.py::x": 50.0,
                                 "tests/test_b.py::unselected": 900.0, "tests/test_c.py::x": 5.0}))
    monkeypatch.setattr(conftest, "SECONDS", table)
    items = [Item(n) for n in ("tests/test_a.py::x", "tests/test_b.py::x", "tests/test_a.py::y",
                               "tests/test_new.py::x", "tests/test_c.py::x", "tests/test_b.py::y[1]",
                               "tests/test_new.py::y")]
    conftest.longest_files_first(items)
    assert [i.nodeid for i in items] == [
        "tests/test_new.py::x", "tests/test_new.py::y",  # not measured: as if the longest
        "tests/test_b.py::x", "tests/test_b.py::y[1]",  # a test not in the table counts nothing
        "tests/test_a.py::x", "tests/test_a.py::y",  # a tie (5 s each): the order they were collected in
        "tests/test_c.py::x"]


def test_without_a_table_the_collection_order_stands(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "SECONDS", tmp_path / "absent.json")
    items = [Item(n) for n in ("tests/test_b.py::x", "tests/test_a.py::x", "tests/test_b.py::y")]
    conftest.longest_files_first(items)
    assert [i.nodeid for i in items] == ["tests/test_b.py::x", "tests/test_b.py::y", "tests/test_a.py::x"]


def test_the_table_sums_setup_call_and_teardown_per_test_over_several_runs():
    part1 = """
12.50s call     tests/test_x.py::test_one[a-b]
1.25s setup    tests/test_x.py::test_one[a-b]
0.01s teardown tests/test_y.py::test_two
=== 3 passed in 14.0s ===
"""
    part2 = "4.00s call     tests/sub/test_z.py::Case::test_three\n2.00s call     tests/test_y.py::test_four\n"
    assert seconds_table.seconds_of([part1, part2]) == {
        "tests/test_x.py::test_one[a-b]": 13.75, "tests/sub/test_z.py::Case::test_three": 4.0,
        "tests/test_y.py::test_four": 2.0, "tests/test_y.py::test_two": 0.01}


def test_the_checked_in_table_names_only_files_that_exist():
    table = json.loads(conftest.SECONDS.read_text())
    root = conftest.SECONDS.parents[1]
    missing = {n.split("::")[0] for n in table} - {n.split("::")[0] for n in table if (root / n.split("::")[0]).is_file()}
    assert table and not missing, missing
