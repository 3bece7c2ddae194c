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


def _rss() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "RssAnon")):
                key, val = line.split(":", 1)
                out[key] = int(val.split()[0]) * 1024
    return out


class ParquetInMemory(Dataset):
    def __init__(self, files: list[str], input_col: str, target_col: str, rss_report: str | None = None):
        import json
        import time

        import pyarrow.parquet as pq

        before, t0 = _rss(), time.time()

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
        import pyarrow as pa

        pa.default_memory_pool().release_unused()  # the files' read buffers, freed but kept by arrow's pool
        self.inputs = torch.from_numpy(self.x)
        self.targets = torch.from_numpy(self.y)
        if rss_report:  # the bench's record of what loading cost this process
            after = _rss()
            os.makedirs(rss_report, exist_ok=True)
            with open(os.path.join(rss_report, f"load-{os.getpid()}.json"), "w") as f:
                json.dump({"pid": os.getpid(), "rss_before": before.get("VmRSS"), "rss_after": after.get("VmRSS"),
                           "anon_before": before.get("RssAnon"), "anon_after": after.get("RssAnon"),
                           "started": t0, "ended": time.time(), "bytes": self.x.nbytes + self.y.nbytes}, f)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.inputs[i], self.targets[i]

    def get_batch(self, indices: list[int]):
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.inputs[idx], self.targets[idx]


def parquet_in_memory(paths: str, input: str = "x", target: str = "y", rss_report: str | None = None) -> ParquetInMemory:
    """`rss_report`: a folder where each process writes its RSS just before and after the load."""
    files = sorted(glob.glob(os.path.expanduser(paths))) if not os.path.isdir(paths) else sorted(
        glob.glob(os.path.join(paths, "*.parquet")))
    if not files:
        raise FileNotFoundError(f"no Parquet files match {paths!r}")
    return ParquetInMemory(files, input, target, rss_report)
