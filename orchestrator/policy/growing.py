"""Whether taking more workers in pays, under `strategy: auto`: a grow is a move like any other,
priced by the online cost model (orchestrator/policy/online.py) before it is made. The larger
world's step is predicted from what the run measured (the device rate, the links, the step's
overhead) on the larger world's nodes; its gain a step over the steps left must pay (1 +
`adapt.switch_margin`) x what the grow costs (the run's measured resizes, else its measured
switches, else two steps). A bigger world across a slow link may not pay: the run stays as it is,
the new workers wait, and the price is taken again every `adapt.window` steps as the link is
fitted anew. Where the run's wait hides the link (all of it behind compute: its fit is only the
slowest link that would still hide it), the larger world is priced as if its wait stayed hidden,
with `adapt.unseen_error`; once grown, the policy of the larger world moves it off a layout whose
wait shows, as on any run. Pure logic: the policy and the worlds in, the verdict and its evidence out."""

from __future__ import annotations

import dataclasses
from statistics import median

from gearshift.orchestrator.policy.adaptive import Policy
from gearshift.orchestrator.policy.online import FREE
from gearshift.strategies.layout import Layout


def price_grow(policy: Policy, target: Layout, node_sizes: list[int], step: int,
               resizes_s: list[float] = ()) -> tuple[bool | None, dict]:
    """Whether moving from the policy's current layout to `target` on a world of `node_sizes`
    pays at `step`, with the evidence; None (and no evidence) while the model has measured
    nothing to predict from."""
    model, c = policy.model, policy.config
    if model is None or model.rate_from is None:
        return None, {}
    now = model.predict(policy.current)
    larger, link_measured = model.on(node_sizes)
    grown = worst = larger.predict(target)
    if model.link_bound:  # the wait hides the link: the larger world is priced as if it hid it too
        grown = model.on(node_sizes, link=FREE)[0].predict(target)
    if not link_measured or model.link_bound:  # the link is a bound, not a measurement
        grown = dataclasses.replace(grown, error=max(grown.error, model.unseen_error))
    left = (policy.total_steps if policy.total_steps is not None else step + c.retry_after) - step
    cost = median(resizes_s) if resizes_s else model.switch_cost(now.step_s)
    gain = now.step_s - grown.pessimistic_s
    pays = gain > 0 and gain * left > cost * (1 + c.switch_margin)
    return pays, {"pays": pays, "from": policy.current.to_dict(), "to": target.to_dict(), "node_sizes": list(node_sizes),
                  "now": now.to_dict(), "grown": grown.to_dict(), "link_measured": link_measured,
                  "link_hidden": model.link_bound, **({"grown_at_slowest_link": worst.to_dict()} if model.link_bound else {}),
                  "gain_s_per_step": gain, "steps_left": left, "grow_cost_s": cost,
                  "switch_margin": c.switch_margin, "model": model.state()}
