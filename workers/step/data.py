"""Built-in data, made by the package itself (nothing is downloaded), and the global batch order.

The order is what makes runs comparable: the samples of global step s are the same whatever
the number of workers, and a data-parallel rank takes its contiguous slice of them.
"""

from __future__ import annotations

import functools
import random

import torch
from torch.utils.data import Dataset, default_collate

from gearshift.workers.step.shares import bounds


class SyntheticDigits(Dataset):
    """MNIST-shaped (1x28x28 inputs, 10 classes) and learnable: each class is a smooth pattern
    seen through heavy pixel noise, so a model has to average over many pixels to classify."""

    def __init__(self, size: int = 8192, signal: float = 0.1, noise: float = 1.0, seed: int = 1234,
                 held_out: bool = False):
        g = torch.Generator().manual_seed(seed)
        # low-frequency class patterns: 7x7 random fields upsampled to 28x28
        coarse = torch.randn(10, 1, 7, 7, generator=g)
        patterns = torch.nn.functional.interpolate(coarse, size=(28, 28), mode="bilinear", align_corners=False)
        if held_out:  # the same classes (patterns), other samples: eval data for a model trained on seed's
            g = torch.Generator().manual_seed(seed + 7_919)
        self.targets = torch.randint(0, 10, (size,), generator=g)
        self.inputs = signal * patterns[self.targets] + noise * torch.randn(size, 1, 28, 28, generator=g)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.inputs[i], self.targets[i]

    def get_batch(self, indices: list[int]):
        idx = torch.as_tensor(indices)
        return self.inputs[idx], self.targets[idx]


_SUBJECTS = ["the engineer", "a small model", "the cluster", "every worker", "the old scheduler", "our team",
             "the network", "a patient reader", "the controller", "each gradient", "the quiet river", "a red fox"]
_VERBS = ["trains", "waits for", "watches", "moves", "counts", "shifts", "measures", "finds", "carries", "follows"]
_OBJECTS = ["the batch", "a long sequence", "the slow link", "every step", "the last checkpoint", "a bright lamp",
            "the weights", "its neighbours", "the morning train", "a simple plan", "the open door", "two loaves"]
_TAILS = [".", " today.", " again.", " at night.", " before dawn.", " without a word.", " with great care.",
          " and then rests.", ", slowly.", " for the tenth time."]


def make_corpus(chars: int = 200_000, seed: int = 7) -> str:
    """A character-level corpus with real structure (words, grammar, punctuation) to learn."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < chars:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}"
        s = s[0].upper() + s[1:] + ("\n" if rng.random() < 0.15 else " ")
        out.append(s)
        n += len(s)
    return "".join(out)[:chars]


class CharCorpus(Dataset):
    """Next-character prediction: sample i is (chars[i*T : i*T+T], chars[i*T+1 : i*T+T+1]) as ASCII ids."""

    def __init__(self, seq_len: int = 64, chars: int = 200_000, seed: int = 7):
        text = make_corpus(chars, seed)
        self.ids = torch.tensor([ord(c) for c in text], dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i: int):
        start = i * self.seq_len
        chunk = self.ids[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]

    def decode(self, ids) -> str:
        """Token ids back to text (`gearshift inspect data` shows token batches with it)."""
        return "".join(chr(int(i)) for i in ids)

    def get_batch(self, indices: list[int]):
        starts = torch.as_tensor(indices).unsqueeze(1) * self.seq_len
        rows = self.ids[starts + torch.arange(self.seq_len + 1)]
        return rows[:, :-1], rows[:, 1:]


@functools.lru_cache(maxsize=2)
def synthetic_digits(size: int = 8192, signal: float = 0.1, noise: float = 1.0, seed: int = 1234,
                     held_out: bool = False) -> SyntheticDigits:
    """held_out: samples of the same classes that training on `seed` never sees (eval.data).

    The same arguments give the same dataset, which nothing writes to: a process that builds it
    again (a rebuild after a switch or a rejoin, the next run in a warm process, a training and an
    evaluation set) takes the last two made (25 MB each at the default size) instead of drawing
    6.4 M samples again."""
    return SyntheticDigits(size, signal, noise, seed, held_out)


def chars(seq_len: int = 64, chars: int = 200_000, seed: int = 7) -> CharCorpus:
    return CharCorpus(seq_len, chars, seed)


class GlobalBatches:
    """The sample indices of every global step: a fresh permutation per pass over the data,
    seeded by (seed, epoch), read as one long stream cut into global batches."""

    def __init__(self, dataset_len: int, global_batch_size: int, seed: int):
        if dataset_len < 1:
            raise ValueError("the dataset is empty")
        self.n = dataset_len
        self.batch = global_batch_size
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=g)
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        pos, end = step * self.batch, (step + 1) * self.batch
        parts = []
        while pos < end:  # a global batch may straddle the end of a pass
            epoch, offset = divmod(pos, self.n)
            take = min(end - pos, self.n - offset)
            parts.append(self._perm(epoch)[offset : offset + take])
            pos += take
        return torch.cat(parts).tolist()

    def shard(self, step: int, rank: int, world: int, shares: tuple[int, ...] | None = None) -> list[int]:
        """Replica `rank`'s slice of step `step`: an even one, or its count of `shares` (shares.py)."""
        lo, hi = bounds(self.batch, rank, world, shares)
        return self.indices(step)[lo:hi]


def load_batch(dataset, indices: list[int], seeds: list[int] | None = None):
    """One batch. A dataset may offer `get_batch(indices) -> (inputs, targets)` to skip
    per-sample indexing and collation (the built-ins do); any map-style dataset works without.
    `seeds`: torch's generator is seeded with seeds[k] before item k is read (augmentation per
    sample); a dataset's own get_batch reads the batch at once, under the seed set before."""
    get_batch = getattr(dataset, "get_batch", None)
    if get_batch is not None:
        return get_batch(indices)
    if seeds is None:
        return default_collate([dataset[i] for i in indices])
    items = []
    for i, seed in zip(indices, seeds):
        torch.default_generator.manual_seed(seed)
        items.append(dataset[i])
    return default_collate(items)


def tokens_per_sample(dataset) -> int | None:
    """Targets that are sequences of integer ids (a language model's next tokens) count as
    tokens; other targets (a class, a regression value) do not."""
    if hasattr(dataset, "token_targets"):  # a streamed dataset: its feeder looked at the first row
        return dataset.token_targets
    target = dataset[0][1]
    if isinstance(target, torch.Tensor) and target.dim() >= 1 and not target.is_floating_point():
        return int(target.numel())
    return None
