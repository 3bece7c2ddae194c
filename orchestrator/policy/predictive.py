"""Rules P1 and P2 of the adaptive policy (adaptive.py's doc), deciding by prediction with the
online cost model: every candidate that fits and is not held back is predicted, and the best is
moved to when its gain, with its error counted against it, pays the switch over the steps left by
a margin (`Predictive`). Asked at a window's end, and at once when the link changes (`LinkWatch`:
a change point in the per-step comm wait, either way)."""

from __future__ import annotations

from gearshift.orchestrator.policy.decisions import KEEP, AdaptConfig, Decision, Keep, Report, Switch
from gearshift.orchestrator.policy.measures import window_means
from gearshift.orchestrator.policy.standing import Standing


class Predictive:
    """At a window's end while predicting (else None), outside the cooldown: a decision when the
    comm-wait fraction is above `threshold`, and a review while a layout with less tensor
    parallelism exists (the link may have got better). A Keep otherwise: rules 4 to 6 are trial's."""

    def __init__(self, config: AdaptConfig):
        self.config = config

    def __call__(self, st: Standing, window: list[dict], means: dict, step: int) -> Decision | None:
        if not st.predicting:
            return None
        c = self.config
        st.model.update(st.current, window)
        over = means["comm_wait_frac"] > c.threshold
        # a review while a layout with less tensor parallelism, or without stages, is there (the link may be better)
        if st.cooling(step, c.cooldown) or not (over or any(x.tp < st.current.tp or x.pp < st.current.pp
                                                           for x in st.candidates)):
            return KEEP
        return self.weigh(st, means, step, "comm_wait" if over else "review")

    def weigh(self, st: Standing, means: dict, step: int, reason: str) -> Decision:
        """Predict every candidate that fits and is not held back; move to the best when its gain,
        with its error counted against it, pays the switch over the steps left by a margin."""
        c, model = self.config, st.model
        now = model.predict(st.current)
        options, skipped, settled = [], [], {(st.current.tp, st.current.pp)}
        for layout in st.candidates:  # at each (tp, pp) its least sharded layout that fits (adaptive.py's doc)
            key = (layout.tp, layout.pp)
            passed = None if key in settled else st.passed_over(layout)
            if passed is not None:
                skipped.append(passed)
            elif key not in settled:
                settled.add(key)
                if st.open(layout, step):
                    options.append(model.predict(layout))
        best = min(options, key=lambda e: e.pessimistic_s, default=None)
        left = st.total_steps - step if st.total_steps is not None else c.retry_after
        gain, cost = now.step_s - best.pessimistic_s if best else 0.0, model.switch_cost(now.step_s)
        evidence = {"reason": reason, **means, "threshold": c.threshold, "from": st.current.to_dict(),
                    "predictions": [now.to_dict()] + [e.to_dict() for e in options], "gain_s_per_step": gain,
                    "steps_left": left, "switch_cost_s": cost, "switch_margin": c.switch_margin,
                    "model": model.state(), **({"skipped": skipped} if skipped else {})}
        if best is not None and gain > 0 and gain * left > cost * (1 + c.switch_margin):
            st.estimate = best
            return Switch(best.layout, {**evidence, "candidate": best.layout.to_dict(),
                                        "predicted_step_s": best.step_s})
        if reason == "review" or st.held:
            return KEEP
        st.held = True  # said once per layout and link: no move pays
        return Report("hold", evidence)


class LinkWatch:
    """Every step: a change point in the comm wait (the link changed, either way) is a decision
    now, on the steps since the change, rather than at the window's end. During a trial it ends
    the judgement without counting against the move: the steps before the switch were measured at
    another link, so they say nothing of this one. Deciding by trial, a change only bounds what a
    trial is judged against (the steps since it), and the step goes on to the other rules."""

    def __init__(self, config: AdaptConfig, predictive: Predictive):
        self.config, self.predictive = config, predictive

    def __call__(self, st: Standing, record: dict, step: int) -> Decision | None:
        c = self.config
        direction = st.change.add(record["comm_wait_mean"], record["step_time_max"])
        if direction is None:
            return None
        if not st.predicting:
            st.recent = st.recent[-c.change_steps:]
            return None
        since = st.recent[-c.change_steps:]
        before = window_means(st.recent[:-c.change_steps]) if len(st.recent) > c.change_steps else None
        st.recent = list(since)  # the steps at the link as it is now
        restarted = None
        if st.trial is not None:
            trial, st.trial, st.estimate = st.trial, None, None
            restarted = {"reason": "judgement restarted: the link changed during it", "from": trial.layout.to_dict(),
                         "layout": st.current.to_dict(), "samples_per_s_before": trial.rate,
                         "steps_before": trial.steps(), "steps_judged": [st.window[0]["step"], step]}
            st.history.append({"step": step, **Keep(restarted).to_dict()})
        if direction == "up":
            st.model.dropped()  # the link as fitted so far, kept for when it comes back
        st.model.update(st.current, since)
        assumed = st.model.recovered(st.current) if direction == "down" else None
        st.window, st.held = [], False  # windows count afresh under the new link
        st.blocked.clear()  # what was reverted under the old link is predicted afresh
        means = {**window_means(since), "comm_wait_s_before": before["comm_wait_s"] if before else None,
                 "link": direction, **({"link_assumed_gb_s": assumed / 1e9} if assumed is not None else {})}
        decision = self.predictive.weigh(st, means, step, "link_changed")
        if restarted is not None and isinstance(decision, Switch):
            decision.evidence["judgement_restarted"] = restarted
        return decision
