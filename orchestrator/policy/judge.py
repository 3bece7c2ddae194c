"""Rules 1 and P3 of the adaptive policy (adaptive.py's doc): a switch on trial judged against the
layout it left. Its first `early_check` steps revert a clear loss at once; its first full window
keeps it, or reverts it and holds the layout back, longer with each revert of it. A predicted move
is also checked against its prediction, and `max_misses` of them reverted in a row turn the policy
to deciding by trial. "Slower" is slower beyond the noise: `noise_sigmas` standard errors of the
two rates' difference."""

from __future__ import annotations

import math
from collections import Counter

from gearshift.orchestrator.policy.decisions import AdaptConfig, Decision, Keep, Revert
from gearshift.orchestrator.policy.measures import past_warmup, rate, rate_error, window_means
from gearshift.orchestrator.policy.standing import Standing, Trial


def noise(after: list[dict], trial: Trial, sigmas: float) -> float:
    """How much slower than before a trial may measure and still be noise: `sigmas` x the standard
    error of the difference of the two rates. A side with too few steps to show a spread borrows
    the other's relative one."""
    rate_after, rate_before = rate(after), trial.rate
    se_after, se_before = rate_error(after), rate_error(trial.before)
    if not se_before and rate_after > 0:
        se_before = se_after / rate_after * rate_before
    if not se_after and rate_before > 0:
        se_after = se_before / rate_before * rate_after
    return sigmas * math.sqrt(se_after ** 2 + se_before ** 2)


class Judge:
    """Asked every step (`early`) and every full window (the call): None while no switch is on trial."""

    def __init__(self, config: AdaptConfig):
        self.config = config
        self.reverts: Counter = Counter()  # layout -> reverts since it was last kept

    def early(self, st: Standing, record: dict, step: int) -> Decision | None:
        """A trial's first `early_check` steps: a clear loss, beyond the noise, is reverted now;
        anything else waits for the full window."""
        c = self.config
        if st.trial is None or not len(st.window) == c.early_check < c.window:
            return None
        after = past_warmup(st.window)
        if rate(after) >= st.trial.rate * (1 - c.early_loss) - noise(after, st.trial, c.noise_sigmas):
            return None
        return self._verdict(st, window_means(st.window), step, st.window, early=True)

    def __call__(self, st: Standing, window: list[dict], means: dict, step: int) -> Decision | None:
        return None if st.trial is None else self._verdict(st, means, step, window)

    def _verdict(self, st: Standing, means: dict, step: int, window: list[dict], early: bool = False) -> Decision:
        trial, st.trial, c = st.trial, None, self.config
        judged = past_warmup(window)  # the new layout's first steps after its build are not its pace
        after, spread = rate(judged), noise(judged, trial, c.noise_sigmas)
        evidence = {**means, "samples_per_s_before": trial.rate, "samples_per_s_after": after,
                    "noise_samples_per_s": spread, "noise_sigmas": c.noise_sigmas,
                    "steps_before": trial.steps(), "steps_judged": [judged[0]["step"], judged[-1]["step"]],
                    "warmup_steps_left_out": len(window) - len(judged),
                    "min_gain": c.min_gain, "from": trial.layout.to_dict(),
                    "layout": st.current.to_dict()}
        if st.model is not None:  # the layout's first steps: its compute and own wait, measured
            st.model.update(st.current, window)
        estimate, st.estimate = st.estimate, None
        if estimate is not None:
            evidence.update(predicted_step_s=estimate.step_s, measured_step_s=means["step_time"],
                            prediction_error=st.model.check(estimate, means["step_time"]))
        if after > trial.rate * (1 + c.min_gain) - spread:  # slower by less than the noise: not evidence
            st.misses = 0 if estimate is not None else st.misses
            st.kept_wait = means["comm_wait_s"]
            self.reverts[st.current] = 0
            if trial.back:  # back where the network allows: hold the layout left back (rule 6)
                st.blocked[trial.layout] = step + c.retry_after
                st.blocked_wait[trial.layout] = means["comm_wait_frac"]
            return Keep({"reason": "kept", **evidence})
        return self._revert(st, trial, step, evidence, early, predicted=estimate is not None)

    def _revert(self, st: Standing, trial: Trial, step: int, evidence: dict, early: bool, predicted: bool) -> Revert:
        c = self.config
        after, before, spread = evidence["samples_per_s_after"], trial.rate, evidence["noise_samples_per_s"]
        # block the layout that did not help so the next slow window does not try it again at once
        # each revert of the same layout doubles its block: a layout that keeps losing is explored ever less
        self.reverts[st.current] += 1
        block = c.retry_after * 2 ** (self.reverts[st.current] - 1)
        st.blocked[st.current] = step + block
        st.blocked_wait[st.current] = trial.wait if trial.wait is not None else 1.0
        if early:
            steps = evidence["steps"]
            evidence["early_loss"] = c.early_loss
            evidence["reason"] = (f"samples/s after {after:.4g} < before {before:.4g} x (1 - {c.early_loss}) "
                                  f"- noise {spread:.3g} in the first {steps[1] - steps[0] + 1} "
                                  f"steps; not retried before step {step + block}")
        else:
            evidence["reason"] = (f"samples/s after {after:.4g} < before {before:.4g} x (1 + {c.min_gain}) - noise "
                                  f"{spread:.3g}; not retried before step {step + block}")
        if predicted:
            st.misses += 1
            if st.misses >= c.max_misses and st.predicting:
                st.predicting = False
                evidence["fallback"] = "trial"
                evidence["reason"] += (f"; {st.misses} predicted moves in a row reverted: the policy decides by "
                                       "trial from here on")
        return Revert(trial.layout, evidence)
