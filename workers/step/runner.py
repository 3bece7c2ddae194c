"""StepRunner: the worker's step part. One optimizer step on this rank: its batch, the seeded
forward and backward (the variant its layout chooses, workers/step/steps.py), the checks on the
gradients, clipping, the learning rate, and the update, skipped where the step is not finite.
Nothing waits for the device: the found-inf flag of a fused optimizer is read with the report.

The worker holds what its parts share (layout, model, optimizer, scaler, the step's share); the
runner keeps what only the step needs: its loader, the checks' state, the skipped steps not yet
reported, whether an update is under way."""

from __future__ import annotations

import contextlib
import time

import torch

from gearshift.strategies import rows as sample_rows
from gearshift.workers.step import precision, shares, steps
from gearshift.workers.step.evaluation import held_out_loss
from gearshift.workers.step.grad_check import GradCheck
from gearshift.workers.step.loader import StepLoader, open_loader, seed_generators, step_seed
from gearshift.workers.step.module_memory import ModuleMemory
from gearshift.workers.step.nonfinite import first_non_finite_module, non_finite_step
from gearshift.workers.step.pending import skips_on_device
from gearshift.workers.step.slow import SlowRank

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class StepRunner:
    def __init__(self, worker):
        self.w = worker
        cfg = worker.config
        self.autocast_dtype = _DTYPES[cfg.precision]
        self.loader: StepLoader | None = None
        self.non_finite: list[dict] = []  # skipped steps not yet reported
        self.grad_check: GradCheck | None = None  # train.grad_check
        self.probe: ModuleMemory | None = None  # rank 0's memory by module, on its first update
        self.updating = False  # inside the optimizer's step: an OOM there leaves the update half applied
        self.micro_setting: int | None = worker.micro_batch  # the micro-batch asked for (set_micro_batch)
        self.slow = SlowRank(cfg.sim_slow) if cfg.sim_slow else None  # inject.slow: a simulated straggler

    def built(self) -> None:
        """The checks that look at the model, once it is first built."""
        w, cfg = self.w, self.w.config
        self.grad_check = GradCheck(dict(cfg.grad_check), w.parallel.model) if cfg.grad_check else None
        self.probe = ModuleMemory() if w.rank == 0 and not cfg.compile else None

    def set_micro_batch(self, micro_batch: int | None) -> int:
        """This rank's share of a step `micro_batch` samples at a time (None: all); the accumulation.
        Under uneven shares every rank takes as many micro-batches, enough for the largest share."""
        w = self.w
        self.micro_setting = micro_batch  # as asked: a larger uneven share is still cut by it
        if w.shares is not None:
            w.micro_batch = micro_batch
            w.accumulation = shares.micro_batches(w.shares, micro_batch)
            return w.accumulation
        share = w.config.global_batch_size // w.layout.dp
        w.micro_batch = micro_batch if micro_batch and micro_batch < share else None
        w.accumulation = share // w.micro_batch if w.micro_batch else 1
        return w.accumulation

    def set_shares(self, counts: list[int] | None) -> dict:
        """Each data-parallel replica's samples of a step from the next step on (None: even), the
        micro-batch kept: {"shares", "accumulation"}. Every rank is given the same list at the same
        step boundary; its loader is opened again at its new slice."""
        w = self.w
        checked = shares.check(counts, w.layout.dp, w.config.global_batch_size)
        if checked is not None and w.parallel.step_variant is not None:
            raise shares.SharesError(f"shares {list(checked)}: the {w.layout.strategy} layout takes even shares only")
        if checked is not None:
            shares.micro_batches(checked, self.micro_setting)  # refused before anything changes
        w.shares = checked
        self.close_loader()
        return {"shares": list(checked) if checked else None, "accumulation": self.set_micro_batch(self.micro_setting)}

    def seed(self, step: int) -> None:
        # one stream per data-parallel replica and pipeline position: a tensor-parallel group draws
        # the same masks and augmentations (Layout.seed_stream)
        w = self.w
        seed_generators(step_seed(w.config.seed, step, w.layout.seed_stream(w.rank)), w.device)

    def rows(self, step: int) -> sample_rows.Rows | None:
        """The global-batch places of this rank's share of `step`, for dropout masks per sample
        (train.random_per: sample); None: torch's dropout from the seeded stream."""
        w = self.w
        if w.config.random_per != "sample":
            return None
        lo, hi = shares.bounds(w.config.global_batch_size, w.layout.dp_rank(w.rank), w.layout.dp, w.shares)
        return sample_rows.Rows(w.config.seed, step, sample_rows.places(lo, hi, w.device))

    def autocast(self):
        """Autocast to the job's dtype, after the fp32 warm-up steps (precision phases)."""
        if self.autocast_dtype is None:  # fp32: a disabled autocast still costs ~0.1 ms a step to enter
            return contextlib.nullcontext()
        return torch.autocast(self.w.device.type, dtype=self.autocast_dtype,
                              enabled=precision.autocast_on(self.w.step, self.w.config))

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor, rows: sample_rows.Rows | None = None) -> torch.Tensor:
        with self.autocast(), sample_rows.within(rows):
            return self.w.loss_fn(self.w.parallel.module(x), y)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of global step `step` (every rank of a tensor-parallel group works
        on its data-parallel replica's slice), from a loader started where the run is."""
        w = self.w
        if self.loader is None or self.loader.next_step != step:
            self.close_loader()
            self.loader = open_loader(w.config, w.dataset, w.batches, step, w.layout.dp_rank(w.rank), w.layout.dp,
                                      w.device, w.shares)
        return self.loader.next()

    def close_loader(self) -> None:
        if self.loader is not None:
            self.loader.close()
            self.loader = None

    def one_step(self, step: int) -> tuple[torch.Tensor, tuple | None, float, torch.Tensor | None]:
        """One optimizer step: (loss, data span, lr, the found-inf flag a fused optimizer skipped on,
        else None). Nothing waits for the device: norms only for clipping; the flag is read later."""
        w, clock = self.w, self.w.clock
        data_start = clock.mark() if clock else None
        x, y = self.batch(step)  # seeded by the step before loading: augmentation draws the same anywhere
        x, y = x.to(w.device, non_blocking=True), y.to(w.device, non_blocking=True)
        data_span = (data_start, clock.mark()) if clock else None
        self.seed(step)  # dropout draws the same whichever process loaded the batch
        w.optimizer.zero_grad(set_to_none=True)
        if self.slow is not None:  # inject.slow: before the gradients exist, so it counts as compute
            self.slow.before_compute(w.rank, step, len(x))
        started, waited = time.perf_counter(), clock.wait if clock and not clock.cuda else 0.0
        with self.probe.watching(w.parallel.model) if self.probe else contextlib.nullcontext():
            loss = steps.choose(w.parallel, w.accumulation, uneven=w.shares is not None)(self, x, y, self.rows(step))
        if self.slow is not None:  # its own compute: less what it waited on peers inside the step (a pipeline's)
            waited = (clock.wait if clock and not clock.cuda else 0.0) - waited
            self.slow.computed(time.perf_counter() - started - waited, len(x))
        if clock:
            clock.after_backward()
        w.parallel.after_backward()
        if self.grad_check and self.grad_check.due(step):  # per-parameter norms, before clipping
            self.grad_check.check(step, w.parallel.model, loss, w.lr_at(step + 1), w.scaler,
                                  w.batches.shard(step, w.layout.dp_rank(w.rank), w.layout.dp, w.shares))
        lr, found, skipped = self._update(step, x, loss)
        return loss, data_span, lr, (None if skipped else found)

    def _update(self, step: int, x: torch.Tensor, loss: torch.Tensor) -> tuple[float, torch.Tensor | None, bool]:
        """Clip, set the rate, and apply the update unless the gradients are not finite:
        (lr, the flag handed to a fused optimizer or None, whether the host skipped the step)."""
        w = self.w
        norm = None
        if w.config.grad_clip:
            w.scaler.unscale_(w.optimizer)
            norm = w.parallel.clip_grad_norm(w.config.grad_clip)
        lr = w.lr_at(step + 1)
        for group in w.optimizer.param_groups:
            group["lr"] = lr
        found = None
        if not w.scaler.is_enabled():  # fp16's scaler finds inf gradients and skips the step itself
            # the same on every rank (the clipping norm is global, or the layout agrees on it), so
            # every rank takes the same decision; a non-finite loss makes non-finite gradients
            found = w.parallel.found_inf(norm)
            if not skips_on_device(w.optimizer):  # the loop and foreach kernels take no flag: the host reads it
                if found.item():
                    self._non_finite(step, x, loss, norm if norm is not None else w.parallel.grad_norm())
                    return lr, None, True
                found = None
        self.updating = True
        if found is not None:  # what GradScaler hands a fused optimizer: it skips the update if found
            w.optimizer.grad_scale, w.optimizer.found_inf = None, found
        try:
            w.scaler.step(w.optimizer)
        finally:
            if found is not None:
                del w.optimizer.grad_scale, w.optimizer.found_inf
        w.scaler.update()
        self.updating = False
        return lr, found, False

    def _non_finite(self, step: int, x: torch.Tensor, loss: torch.Tensor, norm: torch.Tensor) -> None:
        """A step whose loss or gradient norm is NaN or Inf: its update is not applied (the state
        stays as the last good step left it) and the batch is skipped, or the run stops."""
        w = self.w
        w.optimizer.zero_grad(set_to_none=True)

        def forward():
            self.seed(step)
            with self.autocast(), sample_rows.within(self.rows(step)):  # the step's own masks
                w.parallel.model(x)

        self.non_finite.append(non_finite_step(step, loss, norm, first_non_finite_module(w.parallel.model, forward),
                                               stop=w.config.on_nan == "stop"))

    def evaluate(self, max_batches: int | None = None) -> dict:
        """Mean loss over the held-out data under the layout in force (see TrainWorker.evaluate)."""
        w = self.w
        if w.eval_dataset is None:
            raise RuntimeError("evaluate: this job has no eval.data (eval.every is 0)")
        forward_loss = self.forward_loss
        if w.parallel.step_variant == "pipelined":  # forward through the stages: the last one's loss
            def forward_loss(x, y):
                with self.autocast():
                    return w.parallel.evaluate(x, y, w.loss_fn)
        return held_out_loss(w.eval_dataset, forward_loss, w.parallel.module, w.device,
                             w.config.global_batch_size, w.layout, w.rank, w.world, max_batches,
                             micro_batch=w.micro_batch)
