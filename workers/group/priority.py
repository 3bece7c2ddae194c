"""The worker's CPU priority: the node's Ray's own, not the lower one Ray gives its workers.

Ray starts every worker process 15 nice levels below the raylet (`RAY_worker_niceness`, there so a
busy task cannot starve the raylet). A training worker is the job itself, and its ranks move in
lockstep: whenever any other process on a node wants a core (a daemon waking up, a neighbour's
job), the kernel hands it over at once to a nice-0 process, the niced rank stalls, and every rank
waits for it at the next all-reduce. torchrun's ranks run at their shell's priority; measured on
2 cores with other work beside the run, the workers at nice 15 trained 10-30 % slower than
the same workers at the raylet's priority (docs/benchmarks.md). Raising a priority needs
CAP_SYS_NICE or RLIMIT_NICE: without them the worker keeps the one it has and says so.
"""

from __future__ import annotations

import os


def as_parent() -> dict:
    """Give every thread of this process the parent process's (the raylet's) niceness where it has
    a higher one. Linux keeps a niceness per thread and a new thread takes its creator's, so the
    threads that exist now are each set (the actor's method threads, the collectives' threads);
    call it again after a step where threads may have been started. {"nice": the niceness now,
    "was": before (when it changed), "why": why not (when it could not)}."""
    try:
        parent = os.getpriority(os.PRIO_PROCESS, os.getppid())
        threads = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
        before = {t: os.getpriority(os.PRIO_PROCESS, t) for t in threads}
    except (OSError, AttributeError, ValueError):  # no such call here (not POSIX), or the parent is gone
        return {"nice": None}
    mine = max(before.values())
    if mine <= parent:
        return {"nice": mine}
    for tid, nice in before.items():
        if nice > parent:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, parent)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
            except OSError as err:  # not allowed to raise it: run as Ray started it
                return {"nice": mine, "why": f"{type(err).__name__}: {err.strerror or err}"}
    return {"nice": parent, "was": mine}
