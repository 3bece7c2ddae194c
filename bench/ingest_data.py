"""The map-style side of bench/ingest.py: the bench's Parquet files read whole into memory with
pyarrow, as a user without streaming would load them. Job: `data: {entrypoint:
"ingest_data:parquet_in_memory", kwargs: {paths: GLOB}}` with this file on the job's search path
(bench/ingest.py copies it next to the job file it writes).

Every worker holds all of it (gearshift's global order indexes the whole dataset on every rank):
the rows go into one preallocated array, a file at a time, so the peak while loading is the
dataset plus one file, not twice the dataset."""

from __future__ import annotations

import glob
import os

import numpy as np
import torch
from torch.utils.data import Dataset


def _column_array(chunk, rows: int) -> np.ndarray:
    """A tensor-extension (or plain list) column chunk as a (rows, ...) ndarray, copied once."""
    arr = getattr(chunk, "storage", chunk)  # Ray's tensor extension: its storage is a list array
    if hasattr(arr, "flatten"):  # list / fixed-size list: the values, offsets applied
        return arr.flatten().to_numpy(zero_copy_only=False).reshape(rows, -1)
    return arr.to_numpy(zero_copy_only=False)


class ParquetInMemory(Dataset):
    def __init__(self, files: list[str], input_col: str, target_col: str):
        import pyarrow.parquet as pq

        counts = [pq.ParquetFile(f).metadata.num_rows for f in files]
        total = sum(counts)
        self.x: np.ndarray | None = None
        self.y = np.empty(total, dtype=np.int64)
        at = 0
        for f, n in zip(files, counts):
            table = pq.read_table(f, columns=[input_col, target_col])
            pos = at
            for chunk in table.column(input_col).chunks:
                part = _column_array(chunk, len(chunk))
                if self.x is None:
                    self.x = np.empty((total, *part.shape[1:]), dtype=np.float32)
                self.x[pos : pos + len(part)] = part
                pos += len(part)
            self.y[at : at + n] = table.column(target_col).to_numpy()
            at += n
            del table
        self.inputs = torch.from_numpy(self.x)
        self.targets = torch.from_numpy(self.y)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.inputs[i], self.targets[i]

    def get_batch(self, indices: list[int]):
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.inputs[idx], self.targets[idx]


def parquet_in_memory(paths: str, input: str = "x", target: str = "y") -> ParquetInMemory:
    files = sorted(glob.glob(os.path.expanduser(paths))) if not os.path.isdir(paths) else sorted(
        glob.glob(os.path.join(paths, "*.parquet")))
    if not files:
        raise FileNotFoundError(f"no Parquet files match {paths!r}")
    return ParquetInMemory(files, input, target)
