"""The adaptive policy's move before an OOM: a rank's peak memory in a window past
`memory_threshold` of its device's moves the run to a candidate predicted to need less, the one
of those that needs the most (the least change). Not judged on speed afterwards: the policy drops
the layout left from its candidates (`Policy.switched`), as it was near its memory."""

from __future__ import annotations

from collections.abc import Callable

from gearshift.orchestrator.policy.decisions import AdaptConfig, Decision, Switch
from gearshift.orchestrator.policy.reports import Said
from gearshift.orchestrator.policy.standing import Standing
from gearshift.strategies.layout import Layout

Memory = tuple[Callable[[Layout], float], int]  # (predicted bytes a rank needs under a layout, device bytes)


class MemoryPressure:
    """None without a memory figure, within the cooldown, or while the peaks stay under the
    threshold; Report("memory_pressure") when no candidate is lighter."""

    def __init__(self, config: AdaptConfig, memory: Memory | None):
        self.config, self.memory, self.said = config, memory, Said(config.cooldown)

    def __call__(self, st: Standing, window: list[dict], means: dict, step: int) -> Decision | None:
        c = self.config
        if self.memory is None or st.cooling(step, c.cooldown):
            return None
        need, device = self.memory
        peaks = [r.get("peak_mem_bytes") for r in window if r.get("peak_mem_bytes") is not None]
        if not device or not peaks or max(peaks) <= c.memory_threshold * device:
            return None
        now = need(st.current)
        lighter = [(need(x), x) for x in st.candidates if x != st.current and st.open(x, step)]
        lighter = [(b, x) for b, x in lighter if b < now]
        evidence = {"reason": "memory_pressure", "peak_mem_bytes": max(peaks), "device_memory_bytes": device,
                    "memory_threshold": c.memory_threshold, "peak_share": max(peaks) / device,
                    "steps": [window[0]["step"], window[-1]["step"]], "from": st.current.to_dict(),
                    "predicted_bytes_now": now,
                    "lighter": [{"layout": x.to_dict(), "bytes": b} for b, x in sorted(lighter, key=lambda o: -o[0])]}
        if not lighter:
            return self.said.report("memory_pressure", None, evidence, step)
        b, to = max(lighter, key=lambda o: o[0])
        return Switch(to, {**evidence, "candidate": to.to_dict(), "predicted_bytes": b})
