"""The adaptive policy: watches merged step records and decides when to shift layouts.

Pure logic, no Ray and no torch.distributed: the controller feeds it every step record in
order (`observe`) and carries out what it returns; it tells the policy when a switch has
really happened (`switched`). Each decision carries the evidence that led to it.

Deciding by prediction (with an online model, `decide: predict`; orchestrator/online.py fits it
from the records): rules 1-3 below hold as they are; then
  P1. a change point in the per-step comm wait (`change_steps` steps beyond `change_factor` x its
      level, either way) is a decision at once, on the steps since the change; so is a window with
      the comm-wait fraction above `threshold` (outside the cooldown), and any window while a
      layout with less tensor parallelism exists (a review: the link may have got better);
  P2. every candidate that fits and is not held back is predicted (at each tp the least sharded
      that fits), each with its error (`OnlineModel.error`) counted against it; the best is
      switched to when its gain over the steps left pays (1 + `switch_margin`) x the switch's
      cost; otherwise Report("hold"), once per layout and link, with every prediction;
  P3. the move is judged as in rule 1, and its measured step checked against its prediction;
      `max_misses` predicted moves reverted in a row and the policy decides by trial (rules 4-6)
      for the rest of the run, saying so in the revert's evidence. A change point lifts every block.

Deciding by trial (`decide: trial`, no model, or after the fallback): rules evaluated once per
full window of steps on the current layout (after `settle`):
  1. after a switch, the first window judges it against the second half of the window that
     led to it: throughput not better -> Revert, and the layout is not retried for
     `retry_after` steps (doubled with each further revert of it). A trial that is clearly worse is cut short:
     after `early_check` steps, samples/s below (1 - `early_loss`) x before reverts at once;
  2. time in data loading above `input_bound_frac` -> Report("input_bound"), no switch;
  3. one rank computing much longer while the others wait on it -> Report("straggler"), no switch;
  4. mean comm-wait fraction above `threshold`, outside the cooldown -> Switch to the next
     candidate that is not blocked;
  5. (4 again) a reverted layout is not retried for `retry_after` steps, unless the wait has
     since grown past 1.5x the wait that first sent the policy there: the network got worse;
  6. the network got better: on a layout the policy moved to and kept, the comm wait in seconds
     fell below half of what it was when the layout was kept -> Switch back to the previous
     candidate, judged like any switch; once that is kept, the layout left is held back like a
     reverted one (rule 5), so the policy does not go straight back to it. Seconds, not the
     fraction: a layout whose own collectives (tensor parallelism inside a node) keep a high
     fraction still shows a faster link as a shorter wait. A steady network never triggers it.

Memory (`fits`, optional): a layout predicted not to fit the devices is never switched to; the
decision's evidence lists the candidates skipped for it (`skipped`: predicted bytes against the
device's). Sharded state (fsdp, hsdp, hybrid with dp_shard) moves more bytes than replicated state
at the same tp and only saves memory, so a move for comm wait goes to a larger tp, taking there the
least sharded layout that fits; without `fits` that is always the replicated one.

Each rule is an object of its own that answers a Decision, or None when the window is not its
to decide; `Rules` lists them in the order they are asked and `Policy` keeps the steps, the
window and the switch on trial (standing.py) and asks them. Rule 1 and P3: judge.py; rules 2 and
3: reports.py; rules 4 to 6: comm_wait.py; P1 and P2: predictive.py; memory: memory_pressure.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gearshift.orchestrator.policy.comm_wait import CommWait, CommWaitFell, Rebase
from gearshift.orchestrator.policy.decisions import KEEP, AdaptConfig, Decision, Fits, Keep, Report, Revert, Switch
from gearshift.orchestrator.policy.judge import Judge
from gearshift.orchestrator.policy.measures import rate, rate_error, window_means
from gearshift.orchestrator.policy.memory_pressure import Memory, MemoryPressure
from gearshift.orchestrator.policy.online import ChangePoint, OnlineModel
from gearshift.orchestrator.policy.predictive import LinkWatch, Predictive
from gearshift.orchestrator.policy.reports import InputBound, Straggler, find_straggler
from gearshift.orchestrator.policy.standing import PassedOver, Standing, Trial
from gearshift.strategies.layout import Layout

# the decisions and the measures were first defined here: their importers still find them here
__all__ = ["KEEP", "TIMING_FIELDS", "AdaptConfig", "Decision", "Fits", "Keep", "PassedOver", "Policy", "Report",
           "Revert", "Rules", "Switch", "Trial", "candidate_layouts", "find_straggler", "rate_error", "window_means"]

# null when telemetry is off: without them there is nothing to judge
TIMING_FIELDS = ("comm_wait_frac_mean", "comm_wait_mean", "data_time_mean", "compute_time_mean")


def candidate_layouts(world: int, node_sizes: list[int], tp_ok: Callable[[int], bool] = lambda tp: True,
                      sharded: bool = True, pipelines: tuple[int, ...] | list[int] = ()) -> list[Layout]:
    """Layouts to try in order, data first, then ever larger node-local tensor-parallel groups;
    at each tp the replicated layout first, then (`sharded`) the same tp with sharded state.

    Ranks are contiguous per node and a tp group is tp consecutive ranks, so a tp that divides
    every node's size keeps every group inside one node: only the dp all-reduce (smaller by tp)
    crosses nodes. A tp that does not would put tensor-parallel collectives, the chattiest
    ones, on the slow link, so it is never offered. `tp_ok` lets the caller drop sizes the
    model cannot shard (heads, hidden size).

    Sharded state, least sharded first (more sharding: less memory, more traffic): at tp 1, hsdp
    with a node's workers as its shard group (two nodes or more, of equal size >= 2: a group
    must be one node, so its all-gathers stay on the fast link), then fsdp over all workers; at
    each hybrid tp, the hybrid with dp_shard. Strategies are named, not looked up: a caller
    keeps those its workers can run.
    """
    if sum(node_sizes) != world or min(node_sizes, default=0) < 1:
        raise ValueError(f"sum(node_sizes={node_sizes}) != world({world}) or a node has no worker")
    out = [Layout("data", world, 1)]
    if sharded and world > 1:
        if len(node_sizes) >= 2 and len(set(node_sizes)) == 1 and node_sizes[0] >= 2:
            out.append(Layout("hsdp", world, 1, node_sizes[0]))
        out.append(Layout("fsdp", world, 1, world))
    for tp in range(2, world + 1):
        if all(n % tp == 0 for n in node_sizes) and tp_ok(tp):
            # tp == world divides every node only when there is one node: that is plain tensor
            if tp == world:
                out.append(Layout("tensor", 1, tp))
                continue
            out.append(Layout("hybrid", world // tp, tp))
            if sharded:
                out.append(Layout("hybrid", world // tp, tp, world // tp))
    # last, `pipelines`' stage counts (the caller's: stages of whole nodes), offered to the predicting
    # policy only (the trial rules move along tensor parallelism and pass them by)
    out += [Layout("pipeline", world // pp, 1, 1, pp) for pp in pipelines if world % pp == 0]
    return out


StepRule = Callable[[Standing, dict, int], "Decision | None"]  # (standing, the record taken, its step)
WindowRule = Callable[[Standing, list[dict], dict, int], "Decision | None"]  # (standing, window, its means, step)


@dataclass(frozen=True)
class Rules:
    """The policy's rules in the order they are asked: `every_step` with each record taken,
    `every_window` at a full window's end. The first that answers decides; when none does, Keep."""
    every_step: tuple[StepRule, ...]
    every_window: tuple[WindowRule, ...]

    @staticmethod
    def default(config: AdaptConfig, memory: Memory | None = None) -> Rules:
        """The rules of the module's doc. A switch on trial is judged before anything else is
        looked at; what no switch mends (input, a straggler) is said before any move; memory before
        speed; by prediction, P2 decides every window it reaches, so rules 4 to 6 are trial's."""
        judge, predictive = Judge(config), Predictive(config)
        return Rules(every_step=(LinkWatch(config, predictive), judge.early),
                     every_window=(judge, Rebase(), InputBound(config), Straggler(config),
                                   MemoryPressure(config, memory), predictive, CommWaitFell(config), CommWait(config)))


class Policy:
    """Takes the step records in order (`observe`), keeps where the run stands (standing.py) and
    asks its rules; the controller carries out what it returns and tells it when a switch has
    really happened (`switched`). `rules`: the rules of the module's doc when not given."""

    def __init__(self, config: AdaptConfig, candidates: list[Layout], current: Layout, fits: Fits | None = None,
                 model: OnlineModel | None = None, total_steps: int | None = None, memory: Memory | None = None,
                 rules: Rules | None = None):
        self.config, self.fits, self.memory = config, fits, memory  # fits None: memory not judged
        self.model, self.total_steps = model, total_steps
        self.standing = Standing(list(candidates), current, ChangePoint(config.change_factor, config.change_steps),
                                 PassedOver(fits), model, model is not None and config.decide == "predict",
                                 total_steps)
        self.rules = rules if rules is not None else Rules.default(config, memory)
        self._pending: Switch | Revert | None = None  # handed out, not yet carried out
        self._first = True                     # no window judged yet

    @property
    def current(self) -> Layout:
        return self.standing.current

    @property
    def candidates(self) -> list[Layout]:
        return self.standing.candidates

    @property
    def predicting(self) -> bool:
        return self.standing.predicting

    @property
    def history(self) -> list[dict]:
        """Every decision that is not a bare Keep, with its step."""
        return self.standing.history

    def observe(self, record: dict) -> Decision:
        st, step = self.standing, record["step"]
        if self._pending is not None or not self._on_current(record):
            return KEEP  # the switch is not done yet, or a late record from the old layout
        if any(record.get(f) is None for f in TIMING_FIELDS):
            return KEEP
        if st.since is not None and step <= st.since + self.config.settle:
            return KEEP
        st.window.append(record)
        st.recent = (st.recent + [record])[-self.config.window:]
        decision = next((d for rule in self.rules.every_step if (d := rule(st, record, step)) is not None), None)
        if decision is not None:
            st.window = []
        elif len(st.window) < self._size():
            return KEEP
        else:
            window, st.window, self._first = st.window, [], False
            decision = self._decide(window, step)
        if isinstance(decision, (Switch, Revert)):
            self._pending = decision
        if not isinstance(decision, Keep) or decision.evidence:
            st.history.append({"step": step, **decision.to_dict()})
        return decision

    def next_decision(self, step: int) -> int:
        """The first step after `step` at which a decision may come, with every record up to `step`
        observed: the controller ends its chunks there, so a decision is carried out on its step."""
        c, st = self.config, self.standing
        need = (c.early_check if st.trial is not None and len(st.window) < c.early_check < c.window
                else self._size()) - len(st.window)
        begin = step if st.since is None else max(step, st.since + c.settle)
        return max(step + 1, begin + need)

    def switched(self, to: Layout, step: int, seconds: float | None = None) -> None:
        """The controller has carried out a switch (or revert, or a forced one) at `step`, in
        `seconds` (the online model learns a switch's cost from it). Call it with the layout in
        force: if a switch failed and the old layout stays, that one; the pending decision is cleared."""
        st, pending, self._pending = self.standing, self._pending, None
        judged = isinstance(pending, Switch) and pending.to == to
        if judged and pending.evidence.get("reason") == "memory_pressure":
            judged, left = False, st.current  # kept whatever its speed: the layout left was near its memory
            st.candidates = [c for c in st.candidates if c != left]
        if self.model is not None and to != st.current:
            self.model.entered(to)
            self.model.switched(seconds)
        st.estimate = st.estimate if judged and "predicted_step_s" in pending.evidence else None
        st.change.reset()
        # judged against the old layout's latest steps at the link as it is (observe stops adding
        # records once a decision is out, so these are the steps the decision saw)
        before = st.recent or None
        st.recent, st.held = [], False
        if judged:
            evidence = pending.evidence
            st.trial = Trial(st.current, before or [], rate(before) if before else evidence["samples_per_s_recent"],
                             back=evidence.get("reason") == "comm_wait_fell", wait=evidence.get("comm_wait_frac"))
        else:
            st.trial = None
        st.current, st.since, st.window = to, step, []
        st.kept_wait, st.rebase = None, False

    def exclude(self, *layouts: Layout) -> None:
        """Never move to these again in this run: they ran out of memory."""
        self.standing.candidates = [c for c in self.standing.candidates if c not in layouts]

    def resume_at(self, step: int) -> None:
        """Records up to `step` were not the policy's to judge (a tuning round changed
        bucket_cap_mb under the current layout): count windows afresh from there, and measure
        again the comm wait the layout was kept at, now with the new setting."""
        st = self.standing
        st.window, st.since = [], step
        st.rebase = st.kept_wait is not None

    def state(self) -> dict:
        st = self.standing
        return {
            "current": st.current.to_dict(),
            "pending": self._pending.to_dict() if self._pending else None,
            "since": st.since, "window_fill": len(st.window),
            "trial": {"from": st.trial.layout.to_dict(), "samples_per_s_before": st.trial.rate,
                      "steps_before": st.trial.steps()} if st.trial else None,
            "blocked": [{"layout": k.to_dict(), "until": v} for k, v in st.blocked.items()],
            "skipped": list(st.skipped), "history": list(st.history),
            "deciding_by": "prediction" if st.predicting else "trial", "missed_in_a_row": st.misses,
            "model": self.model.state() if self.model is not None else None,
        }

    def _on_current(self, r: dict) -> bool:
        c, since = self.standing.current, self.standing.since
        same = (r["strategy"], r["dp"], r["tp"], r.get("shard") or 1) == (c.strategy, c.dp, c.tp, c.shard)
        return same and (since is None or r["step"] > since)

    def _size(self) -> int:
        """Steps a window takes; the run's first, by prediction, `early_check` (a prediction needs fewer)."""
        first = self.standing.predicting and self._first and self.standing.since is None
        return self.config.early_check if first else self.config.window

    def _decide(self, window: list[dict], step: int) -> Decision:
        """A full window, to the window rules in order: the first that answers decides."""
        st, means = self.standing, window_means(window)
        return next((d for rule in self.rules.every_window if (d := rule(st, window, means, step)) is not None), KEEP)
