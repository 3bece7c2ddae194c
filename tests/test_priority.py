"""A worker takes its parent's (Ray's raylet's) CPU priority, on every one of its threads: Ray
starts workers 15 nice levels lower, and a niced rank stalls all ranks whenever anything else
on the node wants a core (workers/group/priority.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, os, threading
from gearshift.workers.group import priority
started = threading.Event(); done = threading.Event()
def run():
    started.set(); done.wait(30)
t = threading.Thread(target=run); t.start(); started.wait()
got = priority.as_parent()
nice = {"main": os.getpriority(os.PRIO_PROCESS, 0), "thread": os.getpriority(os.PRIO_PROCESS, t.native_id)}
done.set(); t.join()
print(json.dumps({"got": got, "nice": nice}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_every_thread_takes_the_parents_niceness():
    parent = os.getpriority(os.PRIO_PROCESS, 0)
    if parent > 14:
        pytest.skip("the test process is niced too far to start a child 5 levels lower")
    out = subprocess.run(["nice", "-n", "5", sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60,
                         check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "why" in result["got"]:  # no CAP_SYS_NICE here: the worker keeps its priority and says why
        assert result["nice"] == {"main": parent + 5, "thread": parent + 5}
        pytest.skip(f"raising a priority is not allowed here: {result['got']['why']}")
    assert result["got"] == {"nice": parent, "was": parent + 5}
    assert result["nice"] == {"main": parent, "thread": parent}  # the thread started before the call too


def test_nothing_changes_at_the_parents_niceness():
    """In a child started at this process's niceness (as Ray's raylet starts a worker it does not
    nice): nothing to raise. Run in a child, not here: this process's own parent (a shell, make,
    an IDE) may run at another niceness, and as_parent would then change this test process's."""
    parent = os.getpriority(os.PRIO_PROCESS, 0)
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["got"] == {"nice": parent}
    assert result["nice"] == {"main": parent, "thread": parent}
