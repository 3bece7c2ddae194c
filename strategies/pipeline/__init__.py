"""Pipeline parallelism: where the model is cut (cut.py), a stage made from the whole model
(stage.py), and the layout that runs the stages under a schedule (parallel.py)."""


def microbatches(share: int, pp: int, given: int | None = None) -> int:
    """parallel.pp_microbatches resolved: `given`, else the largest number up to 2 x pp that
    divides `share` (a replica's samples in one pass through the stages)."""
    if given is not None:
        return given
    return max(m for m in range(1, 2 * pp + 1) if share % m == 0)
