"""A simulated network, for trying adaptive mode on one machine: the workers are grouped into
`inject.nodes` simulated nodes (consecutive ranks), and every collective whose group spans
nodes takes `bytes / mb_per_s + latency_ms` longer (`inject.link`); `inject.comm_delay_ms`
adds a fixed delay to every collective.

The delays are added by wrappers around the collectives, inside whatever times them
(monitoring/comm.py), so they show up as comm wait exactly as a slow link would.
"""

from __future__ import annotations

import contextlib
import time

import torch

from gearshift.monitoring.comm import wrap_functional_collectives
from gearshift.strategies.layout import Layout


class SimulatedNetwork:
    def __init__(self, delay_ms: float, link: dict | None, slow: dict[str, bool]):
        self.delay_s = delay_ms / 1000.0
        self.link = (link["mb_per_s"] * 1e6, link["latency_ms"] / 1000.0) if link else None
        self.slow = slow  # {"dp", "tp", "pp": whether this rank's group spans nodes}

    @classmethod
    def for_rank(cls, delay_ms: float, nodes: int, link: dict | None, layout: Layout, rank: int):
        """The delays rank `rank` sees under `layout`, or None when nothing is simulated."""
        if not delay_ms and not link:
            return None
        node = [r // (layout.world // nodes) for r in range(layout.world)]
        tp_group = layout.tp_groups()[rank // layout.tp]
        stage, replicas = layout.stage_of(rank), layout.dp * layout.tp  # ranks are stage-major
        dp_group = [stage * replicas + d * layout.tp + rank % layout.tp for d in range(layout.dp)]
        pp_group = [s * replicas + rank % replicas for s in range(layout.pp)]
        return cls(delay_ms, link, {"tp": len({node[r] for r in tp_group}) > 1,
                                    "dp": len({node[r] for r in dp_group}) > 1,
                                    "pp": len({node[r] for r in pp_group}) > 1})

    def delay(self, nbytes: int, dim: str) -> float:
        """Seconds one collective of `nbytes` on mesh dimension `dim` takes longer."""
        delay = self.delay_s
        if self.link is not None and self.slow.get(dim):
            delay += nbytes / self.link[0] + self.link[1]
        return delay

    @contextlib.contextmanager
    def blocked(self, nbytes: int, dim: str):
        """Around a blocking collective: the link's share is paid once it returns."""
        yield
        delay = self.delay(nbytes, dim)
        if delay:
            time.sleep(delay)

    def ddp_hook(self, inner):
        """A DDP comm hook whose all-reduce completes later by the link's delay. On gloo the
        callback runs on the communication thread once the all-reduce completes; an NCCL
        future is complete at launch, so there it delays the launching thread."""

        def hook(process_group, bucket):
            buffer = bucket.buffer()
            delay = self.delay(buffer.numel() * buffer.element_size(), "dp")

            def done(f):
                if delay:
                    time.sleep(delay)
                return f.value()

            return inner(process_group, bucket).then(done)

        return hook


# ---------------------------------------------------------------- DTensor's collectives

_ACTIVE: SimulatedNetwork | None = None


def _delay_launch(net: SimulatedNetwork, orig, args, kwargs):
    out = orig(*args, **kwargs)
    # DTensor's collectives here are those of the tensor-parallel mesh dimension
    sent = args[0] if args and isinstance(args[0], torch.Tensor) else None
    delay = net.delay(sent.numel() * sent.element_size() if sent is not None else 0, "tp")
    if delay:
        time.sleep(delay)
    return out


def delay_functional_collectives(net: SimulatedNetwork | None) -> None:
    """Route DTensor's functional collectives through `net` (None: no delay). Installed before
    the comm clock's timing wrappers (the worker installs both, this first), so the timing
    sees the delay as part of the collective."""
    global _ACTIVE
    import torch.distributed._functional_collectives as funcol

    if getattr(funcol, "_gearshift_timed", False) and not getattr(funcol, "_gearshift_delayed", False):
        raise RuntimeError("the simulated network must wrap the functional collectives before comm timing does")
    wrap_functional_collectives("_gearshift_delayed", lambda: _ACTIVE, _delay_launch)
    _ACTIVE = net
