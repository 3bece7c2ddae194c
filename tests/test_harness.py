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


# ---------------------------------------------------------------- the warm pool keeps nothing

def _layouts_then_threads(rank: int, world: int, out: str, call: int) -> None:
    """A data layout with its all-reduce routed through a hook, then a tensor-parallel one, each
    trained a step and torn down; then this process's thread count, as the next call finds it
    (the pool resets the process between calls: tests/gloo_pool.py's _reset)."""
    import gc
    import os

    import torch

    from gearshift import strategies
    from gearshift.monitoring.comm import CommClock
    from gearshift.strategies import Layout, Options, data
    from gearshift.workers.build.models import gpt, mlp
    from gearshift.workers.group.comm import CommRoute

    options = Options(torch.device("cpu"))
    torch.manual_seed(0)
    par = data.apply(mlp(hidden=32), None, Layout("data", world, 1), None, options)
    par.attach(CommRoute(CommClock(torch.device("cpu")), None))
    par.module(torch.randn(4, 784)).sum().backward()
    par.detach()
    torch.manual_seed(0)
    model = gpt(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    par = strategies.parallelize(model, Layout("tensor", 1, world), model.tp_plan(world), options)
    par.module(torch.randint(0, 64, (2, 8))).sum().backward()
    del par, model
    gc.collect()
    with open(os.path.join(out, f"call{call}-rank{rank}"), "w") as f:
        f.write(str(len(os.listdir("/proc/self/task"))))


def test_a_warm_pool_process_ends_each_call_with_the_threads_it_began_with(tmp_path):
    """A pool process serves run after run, so whatever a run keeps past its end accumulates
    there: torn-down layouts kept their process groups (each with gloo's threads and
    connections) until the process ended, hundreds of threads per process by the end of part 1.
    The count a call leaves behind must not grow from one call to the next. The first call may
    still add what is made once per process (torch's own pools), so the second and third are
    compared (7 and 8 threads after each call here; 16 and 19 growing by 3 a call before the
    layouts let go of their groups)."""
    import gloo_pool

    for call in range(3):
        gloo_pool.run(_layouts_then_threads, 2, (str(tmp_path), call), timeout_s=120)
    counts = {call: sorted(int((tmp_path / f"call{call}-rank{r}").read_text()) for r in range(2)) for call in range(3)}
    assert counts[2] == counts[1], counts
