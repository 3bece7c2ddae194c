"""This rank's batches, step by step, read in the step loop or ahead by loader processes.

The order is gearshift's own (`GlobalBatches`: the samples of global step s, and this rank's
slice of them), so the batches are the same for any number of loader processes, and a loader
started at step s after a resume, a switch or a recovery reads exactly what an uninterrupted
run would. Loader processes are a torch DataLoader whose "samples" are step numbers: each
process loads whole steps, and the DataLoader hands them over in step order.
"""

from __future__ import annotations

import itertools
import sys
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from gearshift.workers.build import components
from gearshift.workers.step import streaming
from gearshift.workers.step.data import GlobalBatches, load_batch
from gearshift.workers.step.shares import bounds


def step_seed(seed: int, step: int, rank: int) -> int:
    """RNG state is a function of (seed, step, rank): a resumed run draws what the original drew."""
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63 - 1)


def sample_seed(seed: int, step: int, place: int) -> int:
    """The seed a map-style dataset's item is read under when augmentation follows the sample
    (train.random_per: sample): a function of (seed, step, its place in the global batch)."""
    return (step_seed(seed, step, 0) * 6_364_136_223_846_793_005 + place + 1) % (2**63 - 1)


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed the default generators directly: torch.manual_seed costs ~70 us a call on CPU."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index].manual_seed(seed)


class StepBatches(Dataset):
    """Item s: this rank's (inputs, targets) of global step s. The step's seed is set first, so
    a dataset's random augmentation draws the same numbers in any process; with `per_sample`
    (train.random_per: sample) each item is read under its own seed (`sample_seed`), so a sample's
    augmentation is the same whichever replica, share or layout reads it."""

    def __init__(self, dataset, batches: GlobalBatches, dp_rank: int, dp: int, seed: int,
                 shares: tuple[int, ...] | None = None, per_sample: bool = False):
        self.dataset, self.batches, self.dp_rank, self.dp, self.seed = dataset, batches, dp_rank, dp, seed
        self.shares, self.per_sample = shares, per_sample

    def __len__(self) -> int:  # steps go on for as long as the run asks
        return 2**62

    def __getitem__(self, step: int):
        # one stream per data-parallel replica, as the step loop seeds it (torch.manual_seed
        # costs ~70 us a call on CPU: the generator is seeded directly)
        torch.default_generator.manual_seed(step_seed(self.seed, step, self.dp_rank))
        indices = self.batches.shard(step, self.dp_rank, self.dp, self.shares)
        if not self.per_sample:
            return load_batch(self.dataset, indices)
        lo, _ = bounds(self.batches.batch, self.dp_rank, self.dp, self.shares)
        return load_batch(self.dataset, indices, [sample_seed(self.seed, step, lo + i) for i in range(len(indices))])


class _From(Sampler):
    def __init__(self, start: int):
        self.start = start

    def __iter__(self):
        return itertools.count(self.start)


class StepLoader:
    """Batches from `start` on: (step, inputs, targets), in step order."""

    def __init__(self, steps: StepBatches, start: int, workers: int, prefetch: int, pin_memory: bool):
        self.next_step = start
        if workers == 0:
            self._it: Iterator = (steps[s] for s in itertools.count(start))
            self._loader = None
        else:
            # batch_size=None: each item is already a batch; the order of steps is kept
            self._loader = DataLoader(steps, batch_size=None, sampler=_From(start), num_workers=workers,
                                      prefetch_factor=prefetch, pin_memory=pin_memory,
                                      multiprocessing_context="spawn", persistent_workers=False)
            self._it = iter(self._loader)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(self._it)
        self.next_step += 1
        return x, y

    def close(self) -> None:
        """Stop the loader processes (they would otherwise read ahead forever)."""
        it, self._it = self._it, iter(())
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def open_data(cfg, field: str):
    """The dataset a worker trains (field "data") or evaluates ("eval.data") on: map-style, built
    here, or a Ray Dataset read by the feeder actor the driver started for it."""
    spec = dict(cfg.data if field == "data" else cfg.eval_data)
    if streaming.is_streamed(spec):
        return streaming.StreamedData(cfg.feeders[field], cfg.global_batch_size)
    return components.build_dataset(spec, dict(cfg.model), cfg.search_paths)


def open_loader(cfg, dataset, batches: GlobalBatches, step: int, dp_rank: int, dp: int, device: torch.device,
                shares: tuple[int, ...] | None = None):
    """This rank's batches from `step` on, `prefetch` steps ahead: from the feeder for a streamed
    dataset, else read here or by loader processes; an even slice of each step, or its count of
    `shares` (workers/step/shares.py)."""
    if isinstance(dataset, streaming.StreamedData):
        return dataset.loader(step, dp_rank, dp, cfg.loader["prefetch"], shares)
    if cfg.loader["workers"]:  # loader processes unpickle the user's dataset: its module must import
        sys.path[:0] = [p for p in cfg.search_paths if p not in sys.path]
    steps = StepBatches(dataset, batches, dp_rank, dp, cfg.seed, shares, per_sample=cfg.random_per == "sample")
    return StepLoader(steps, step, cfg.loader["workers"], cfg.loader["prefetch"],
                      pin_memory(cfg.loader.get("pin_memory", "auto"), device))


def pin_memory(setting: bool | str, device: torch.device) -> bool:
    """data.loader.pin_memory for a worker on `device`: auto is on with a GPU; page-locked host
    memory only speeds up copies to a GPU, so on CPU it is off whatever the job says."""
    if setting not in (True, False, "auto"):
        raise ValueError(f"data.loader.pin_memory = {setting!r}: must be true, false or 'auto'")
    return device.type == "cuda" and setting is not False
