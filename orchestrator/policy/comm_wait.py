"""Rules 4 to 6 of the adaptive policy (adaptive.py's doc), deciding by trial: a comm wait above
`threshold` moves the run to the next candidate with a larger tp (rules 4 and 5), and a wait that
has fallen to under half of what it was when the layout was kept moves it back one tp (rule 6).
Only a larger tp cuts the traffic, so a tp is settled by its least sharded layout that fits: when
that one is held back, its more sharded twins (more traffic) are not tried."""

from __future__ import annotations

from gearshift.orchestrator.policy.decisions import KEEP, AdaptConfig, Decision, Switch
from gearshift.orchestrator.policy.standing import Standing
from gearshift.strategies.layout import Layout


class Rebase:
    """After `Policy.resume_at` (a tuning round changed the layout's setting), the next window
    measures again the comm wait rule 6 compares against, and decides nothing."""

    def __call__(self, st: Standing, window: list[dict], means: dict, step: int) -> Decision | None:
        if not st.rebase:
            return None
        st.rebase, st.kept_wait = False, means["comm_wait_s"]
        return KEEP


def next_candidate(st: Standing, step: int, wait: float = 0.0) -> tuple[Layout | None, list[dict]]:
    """The layout to move to for comm wait, and the candidates passed over as not fitting."""
    if st.current in st.candidates:
        later = st.candidates[st.candidates.index(st.current) + 1:]
    else:  # a layout forced by hand: only larger tp groups lie further on
        later = [layout for layout in st.candidates if layout.tp > st.current.tp]
    settled, skipped = {st.current.tp}, []
    for layout in later:
        if layout.tp in settled or layout.pp > 1:  # a pipeline is the predicting policy's move alone
            continue
        passed = st.passed_over(layout)
        if passed is not None:
            skipped.append(passed)
            continue
        settled.add(layout.tp)
        if st.open(layout, step) or wait > 1.5 * st.blocked_wait.get(layout, 1.0):
            return layout, skipped
    return None, skipped


def previous_candidate(st: Standing, means: dict, step: int) -> tuple[Layout | None, list[dict]]:
    """The layout before this one (the least sharded that fits at the next smaller tp), once the
    wait that drove the move here has gone; and the candidates passed over as not fitting."""
    if st.kept_wait is None or means["comm_wait_s"] >= 0.5 * st.kept_wait:
        return None, []
    if st.current not in st.candidates:
        return None, []
    earlier = [c for c in st.candidates[:st.candidates.index(st.current)] if c.tp < st.current.tp and c.pp == 1]
    if not earlier:
        return None, []
    skipped = []
    for back in (c for c in earlier if c.tp == earlier[-1].tp):
        passed = st.passed_over(back)
        if passed is None:
            return (back if st.open(back, step) else None), skipped
        skipped.append(passed)
    return None, skipped


class CommWaitFell:
    """Rule 6: on a layout the policy moved to and kept, the comm wait in seconds fell below half
    of what it was when the layout was kept: Switch back to the previous candidate."""

    def __init__(self, config: AdaptConfig):
        self.config = config

    def __call__(self, st: Standing, window: list[dict], means: dict, step: int) -> Decision | None:
        c = self.config
        back, skipped = (None, []) if st.cooling(step, c.cooldown) else previous_candidate(st, means, step)
        if back is None:
            return None
        return Switch(back, {"reason": "comm_wait_fell", **means, "threshold": c.threshold,
                             "comm_wait_s_when_kept": st.kept_wait, "window": c.window,
                             "from": st.current.to_dict(), "candidate": back.to_dict(),
                             **({"skipped": skipped} if skipped else {})})


class CommWait:
    """Rules 4 and 5: the mean comm-wait fraction above `threshold`, outside the cooldown: Switch
    to the next candidate not held back; a Keep when there is none. The last rule asked."""

    def __init__(self, config: AdaptConfig):
        self.config = config

    def __call__(self, st: Standing, window: list[dict], means: dict, step: int) -> Decision | None:
        c = self.config
        if st.cooling(step, c.cooldown) or means["comm_wait_frac"] <= c.threshold:
            return KEEP
        to, st.skipped = next_candidate(st, step, means["comm_wait_frac"])
        if to is None:
            return KEEP  # everything further is blocked, does not fit, or there is nothing further: stay put
        return Switch(to, {"reason": "comm_wait", **means, "threshold": c.threshold,
                           "window": c.window, "from": st.current.to_dict(),
                           "candidate": to.to_dict(), **({"skipped": st.skipped} if st.skipped else {})})
