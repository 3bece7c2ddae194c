"""Pipeline parallelism: where the model is cut (cut.py), a stage made from the whole model
(stage.py), and the layout that runs the stages under a schedule (parallel.py)."""

INTERLEAVED = ("interleaved_1f1b", "interleaved_zb")  # the schedules that hold several stages on each position


def microbatches(share: int, pp: int, given: int | None = None) -> int:
    """parallel.pp_microbatches resolved: `given`, else the largest number up to 2 x pp that
    divides `share` (a replica's samples in one pass through the stages)."""
    if given is not None:
        return given
    return max(m for m in range(1, 2 * pp + 1) if share % m == 0)


def fitted(rows: int, pp: int, asked: int | None, schedule: str = "1f1b") -> int:
    """The micro-batches `rows` samples (one pass through the stages) flow in: as `microbatches`
    resolves them, and where the number asked does not divide `rows` (a share cut down after an
    out-of-memory step), the largest below it that does and that an interleaved schedule's rounds
    of pp divide, so that every micro-batch has the same rows and the step's mean stays exact."""
    limit = min(asked if asked is not None else 2 * pp, rows)

    def runs(m: int) -> bool:
        return rows % m == 0 and (stages_per_rank(schedule) == 1 or m % max(1, m // pp) == 0)

    return max(m for m in range(1, max(1, limit) + 1) if runs(m))


def stages_per_rank(schedule: str) -> int:
    """The stages each position of the pipeline holds under `schedule`: 2 for an interleaved
    one (the model cut into pp x 2 stages), else 1."""
    return 2 if schedule in INTERLEAVED else 1


# the part of a stage's work a filling or draining pipeline idles for: all of it, but under zero
# bubble only the forward (the backward of the inputs fills it; the weights' waits): 1/3 where a
# forward, an input backward and a weight backward cost alike (ZB-H1's analysis; not measured here)
FILL_SHARE = {"interleaved_zb": 1 / 3}


def bubble(pp: int, microbatches: int, schedule: str = "1f1b") -> float:
    """The share of a step a position is idle for lack of work, `f (pp - 1) / (v m + f (pp - 1))`:
    v the stages each position holds (1 for GPipe and 1F1B, 2 interleaved), f FILL_SHARE (1 but
    for zero bubble)."""
    v, f = stages_per_rank(schedule), FILL_SHARE.get(schedule, 1.0)
    return f * (pp - 1) / (v * microbatches + f * (pp - 1)) if pp > 1 else 0.0
