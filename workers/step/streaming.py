"""Ray Data datasets streamed to the workers in gearshift's own global order.

One `Feeder` actor per dataset runs the Ray Data pipeline once for the whole job and cuts its
rows into global batches; each worker asks it for its slice of each step (the data-parallel
ranks of a layout split the batch, the tensor-parallel ranks of a group take the same slice)
and keeps `prefetch` steps in flight, so reading overlaps the step. Nothing on a worker grows
with the dataset: it holds the slices of the steps in flight, the feeder the steps ahead and
one shuffle window.

The order is a function of (seed, step) alone, never of the number of workers or the layout:

- pass p reads the dataset with its block order shuffled by a seed derived from (seed, p), in
  that order (Ray Data's `preserve_order`), cut into windows of `shuffle_buffer` rows; each
  window's rows are permuted by a generator seeded with (seed, p, window);
- the passes follow each other as one stream of rows; global batch s is rows [s*G, (s+1)*G),
  and may straddle two passes.

So a worker started at step s (a resume, a recovery, a switch that changes dp) reads exactly
what an uninterrupted run reads at s. The cost: the feeder reaches step s by reading pass p
from its start and dropping the rows before s (up to one pass of reading, no training), and
the shuffle is a windowed one (block order, then rows within a window), not a full permutation.
"""

from __future__ import annotations

import collections
import glob
import itertools
import logging
import os
import threading
import time
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from gearshift.workers.build.components import ComponentError, _call, _on_path, resolve
from gearshift.workers.step.shares import bounds

READERS = ("parquet", "json", "csv", "images")
TAKE_TIMEOUT_S = 600.0  # a step's rows not ready after this long: the feeder reports why
_IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "bmp", "gif", "tif", "tiff", "webp")


def is_streamed(spec) -> bool:
    """A data spec that names a Ray Dataset (ray_dataset) or files Ray Data reads (read)."""
    return bool(spec and (spec.get("ray_dataset") or spec.get("read")))


def local_matches(paths) -> list[str]:
    """The local files `paths` (a path, a glob, a folder, or a list of them) stand for; URIs
    (s3://, gs://, ...) are left to Ray Data. Raises ComponentError for a path matching nothing."""
    found = []
    for p in [paths] if isinstance(paths, str) else list(paths):
        if "://" in p:
            found.append(p)
            continue
        hits = sorted(glob.glob(os.path.expanduser(p), recursive=True))
        if not hits:
            raise ComponentError("data.paths", p, "matches no file or folder", f"(looked from {os.getcwd()})")
        found.extend(hits)
    return found


def build_ray_dataset(spec: dict, search_paths: Iterable[str] = (), field: str = "data"):
    """The ray.data.Dataset a data spec names."""
    import ray.data

    kwargs = dict(spec.get("kwargs") or {})
    if spec.get("read"):
        paths = _rooted(spec["paths"], search_paths)
        files = local_matches(paths)  # Ray Data's readers take files and folders, not globs
        if spec["read"] == "images":
            return _read_images(files, kwargs)
        reader = {"parquet": ray.data.read_parquet, "json": ray.data.read_json, "csv": ray.data.read_csv}[spec["read"]]
        return _call(field, f"ray.data.read_{spec['read']}", reader, {"paths": files, **kwargs})
    func = resolve(f"{field}.ray_dataset", spec["ray_dataset"], search_paths)
    with _on_path(search_paths):
        ds = _call(field, spec["ray_dataset"], func, kwargs)
    if not isinstance(ds, ray.data.Dataset):
        raise ComponentError(f"{field}.ray_dataset", spec["ray_dataset"],
                             f"must return a ray.data.Dataset, got {type(ds).__name__}",
                             "Return the dataset itself (e.g. ray.data.read_parquet(...) or "
                             "ray.data.from_numpy(...)), not a list, a torch Dataset or an iterator.")
    return ds


def _rooted(paths, search_paths) -> Any:
    """Relative paths are read from the job file's folder."""
    base = next(iter(search_paths), ".")

    def root(p: str) -> str:
        return p if "://" in p or os.path.isabs(os.path.expanduser(p)) else os.path.join(base, p)

    return root(paths) if isinstance(paths, str) else [root(p) for p in paths]


def _read_images(paths, kwargs: dict):
    """Images with a `label` column: the index of each file's folder among the folders found
    (a class per folder, sorted by name), as torchvision's ImageFolder labels them."""
    import ray.data

    files = [f for f in paths if os.path.isfile(f)] + [
        f for d in paths if os.path.isdir(d)
        for f in glob.glob(os.path.join(d, "**", "*"), recursive=True) if f.lower().rsplit(".", 1)[-1] in _IMAGE_EXTENSIONS]
    classes = sorted({os.path.basename(os.path.dirname(f)) for f in files})
    if not classes:
        raise ComponentError("data.paths", paths, "holds no image files (" + ", ".join(_IMAGE_EXTENSIONS) + ")")
    index = {c: i for i, c in enumerate(classes)}
    ds = _call("data", "ray.data.read_images", ray.data.read_images, {"paths": list(paths), "include_paths": True,
                                                                      **kwargs})

    def label(batch: dict) -> dict:
        batch["label"] = np.array([index.get(os.path.basename(os.path.dirname(p)), -1) for p in batch["path"]],
                                  dtype=np.int64)
        return batch

    return ds.map_batches(label, batch_format="numpy")


# ---------------------------------------------------------------- rows to tensors

def _column(batch: dict, name: str) -> np.ndarray:
    col = batch[name]
    if col.dtype == object:  # a column of variable-typed arrays or lists: one array per row
        col = np.stack([np.asarray(v) for v in col])
    return col


def to_arrays(batch: dict, input_cols, target_col: str) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of a Ray Data numpy batch. Several input columns are stacked along a
    last axis (CSV features); floating data arrives as float32, integer targets as int64
    (what torch's losses take); images (uint8, H x W x C) as float32 C x H x W in [0, 1]."""
    if isinstance(input_cols, str):
        x = _column(batch, input_cols)
        if x.dtype == np.uint8 and x.ndim == 4:
            x = np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32) / 255.0
    else:
        x = np.stack([_column(batch, c) for c in input_cols], axis=-1)
    y = _column(batch, target_col)
    if np.issubdtype(x.dtype, np.floating) and x.dtype != np.float32:
        x = x.astype(np.float32)
    if np.issubdtype(y.dtype, np.floating) and y.dtype != np.float32:
        y = y.astype(np.float32)
    elif np.issubdtype(y.dtype, np.integer) and y.dtype != np.int64:
        y = y.astype(np.int64)
    return x, y


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) % (2**63) for p in parts]).generate_state(1, np.uint64)[0] % (2**63))


class Stream:
    """Global batches from step `start` on, in the order the module docstring gives. `cycle`
    False (eval data): one pass in the dataset's own order, the last batch possibly short."""

    def __init__(self, ds, rows: int, input_cols, target_col: str, batch: int, seed: int,
                 shuffle_buffer: int, cycle: bool = True, read_ahead: int = 2):
        self.ds, self.rows, self.input, self.target = ds, rows, input_cols, target_col
        self.batch, self.seed, self.window, self.cycle = batch, seed, shuffle_buffer, cycle
        self.read_ahead = read_ahead

    def _pass(self, p: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Pass p's rows in order, as arrays of a few rows each."""
        if not self.cycle or not self.window:
            ds = self.ds
        else:
            ds = self.ds.randomize_block_order(seed=_seed(self.seed, p, 1) % (2**32))
        ds.context.execution_options.preserve_order = True  # without it, blocks come as they finish
        for block in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=self.read_ahead):
            x, y = to_arrays(block, self.input, self.target)
            if len(y):
                yield x, y

    def _windows(self, p: int, skip: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Pass p's rows from row `skip` on, in shuffled windows; the windows wholly before
        `skip` are counted, not shuffled."""
        shuffled = self.cycle and self.window
        pieces = _cut(self._pass(p), self.window) if shuffled else self._pass(p)
        for w, (x, y) in enumerate(pieces):
            if skip >= len(y):
                skip -= len(y)
                continue
            if shuffled:
                perm = np.random.default_rng(_seed(self.seed, p, 2, w)).permutation(len(y))
                x, y = x[perm], y[perm]
            if skip:
                x, y, skip = x[skip:], y[skip:], 0
            yield x, y

    def batches(self, start: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(step, inputs, targets) for step = start, start + 1, ..."""
        p, skip = divmod(start * self.batch, self.rows)
        if not self.cycle and p > 0:
            return

        def rows() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            yield from self._windows(p, skip)
            if self.cycle:
                for q in itertools.count(p + 1):
                    yield from self._windows(q)

        for step, (x, y) in enumerate(_cut(rows(), self.batch), start):
            yield step, x, y


def _cut(chunks: Iterable[tuple[np.ndarray, np.ndarray]], size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Pieces of exactly `size` rows (the last may be short) from chunks of any size; each row is
    copied at most once (a piece inside one chunk is a view of it)."""
    xs, ys, have = [], [], 0
    for x, y in chunks:
        at, n = 0, len(y)
        while at < n:
            take = min(size - have, n - at)
            xs.append(x[at:at + take])
            ys.append(y[at:at + take])
            have, at = have + take, at + take
            if have == size:
                yield _join(xs), _join(ys)
                xs, ys, have = [], [], 0
    if have:
        yield _join(xs), _join(ys)


def _join(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


# ---------------------------------------------------------------- the feeder actor

class Feeder:
    """Runs one dataset's stream for the whole job and hands out slices of its global batches.

    A producer thread keeps the steps from the lowest one asked for up to `ahead` steps past the
    highest; a step asked for below what it holds (a resume, a recovery, the next evaluation)
    restarts the stream there. Run as a Ray actor with max_concurrency > 1 (ranks ask at once)."""

    def __init__(self, spec: dict, search_paths: list[str], batch: int, seed: int, cycle: bool, ahead: int,
                 field: str = "data"):
        import ray.data

        self.field, self.spec = field, spec
        self.ahead = max(2, ahead)
        self._cv = threading.Condition()
        self._held: collections.OrderedDict[int, tuple[np.ndarray, np.ndarray]] = collections.OrderedDict()
        self._asked = -1  # the highest step asked for
        self._generation = 0
        self._thread: threading.Thread | None = None
        self._failed: str | None = None
        self._end: int | None = None  # eval: the number of batches in the one pass
        self.error: dict | None = None
        logging.getLogger("ray.data").setLevel(logging.WARNING)  # one line per execution otherwise
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "progress bars disabled"
        try:
            ctx = ray.data.DataContext.get_current()
            ctx.execution_options.preserve_order = True
            # Parquet through Ray Data's first datasource: the second reads footers in a pool of
            # actors, a process each, which on a small machine costs more CPU than the reading
            ctx.use_datasource_v2 = False
            # Ray Data reads ahead of the step by this much at most (its own default is a share of
            # the object store, GBs): the rest of the dataset waits where it lies
            ctx.execution_options.resource_limits = ctx.execution_options.resource_limits.copy(
                object_store_memory=READ_AHEAD_BYTES)
            ray.data.DataContext.get_current().enable_progress_bars = False
            ds = build_ray_dataset(spec, search_paths, field)
            self.info = self._check(ds, spec, field)
            self.stream = Stream(ds, self.info["rows"], spec["input"], spec["target"], batch, seed,
                                 spec.get("shuffle_buffer") or 0, cycle=cycle)
            if not cycle:
                self._end = -(-self.info["rows"] // batch)
        except ComponentError as err:
            self.error = {"field": err.field_path, "value": err.value, "allowed": err.allowed, "hint": err.hint}
        except Exception as err:  # the user's pipeline failed: say where, in one line
            self.error = {"field": f"{field}.{'read' if spec.get('read') else 'ray_dataset'}",
                          "value": spec.get("read") or spec.get("ray_dataset"),
                          "allowed": f"building or reading the dataset failed: {type(err).__name__}: "
                                     f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}",
                          "hint": ""}

    @staticmethod
    def _check(ds, spec: dict, field: str) -> dict:
        names = list(ds.schema(fetch_if_missing=True).names)
        inputs = [spec["input"]] if isinstance(spec["input"], str) else list(spec["input"])
        for key, cols in (("input", inputs), ("target", [spec["target"]])):
            for c in cols:
                if c not in names:
                    raise ComponentError(f"{field}.{key}", c, "is not a column of the dataset; its columns are "
                                         + ", ".join(names))
        rows = ds.count()
        if rows < 1:
            raise ComponentError(field, spec.get("ray_dataset") or spec.get("paths"), "gives an empty dataset (0 rows)")
        first = ds.take_batch(1, batch_format="numpy")
        x, y = to_arrays(first, spec["input"], spec["target"])
        tokens = int(y[0].size) if y.ndim >= 2 and np.issubdtype(y.dtype, np.integer) else None
        return {"rows": rows, "columns": names, "row_bytes": int(x[0].nbytes + y[0].nbytes),
                "input_shape": list(x.shape[1:]), "input_dtype": str(x.dtype),
                "target_shape": list(y.shape[1:]), "target_dtype": str(y.dtype), "tokens_per_sample": tokens}

    def describe(self) -> dict:
        return {"error": self.error} if self.error else dict(self.info)

    def take(self, step: int, lo: int, hi: int, parts: int = 1):
        """Rows [lo, hi) of global batch `step` (eval: batch `step` of the one pass); with parts > 1,
        as that many (inputs, targets) pieces, each its own return value (see `parts_for`)."""
        if self.error:
            raise RuntimeError(f"{self.error['field']} = {self.error['value']!r}: {self.error['allowed']}")
        if self._end is not None and step >= self._end:
            raise IndexError(f"eval batch {step} is past the data's {self._end} batches")
        deadline = time.monotonic() + TAKE_TIMEOUT_S
        with self._cv:
            if step > self._asked:
                self._asked = step
            if step not in self._held and (self._thread is None or step < self._low() or step > self._asked_low()):
                self._start(step)
            self._cv.notify_all()
            while step not in self._held:
                if step < self._low():  # a restart elsewhere in the stream left this request behind
                    raise RuntimeError(f"{self.field}: step {step} was superseded by a restart of the stream")
                if self._failed:
                    raise RuntimeError(f"reading {self.field} failed: {self._failed}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.field}: step {step}'s rows were not read within {TAKE_TIMEOUT_S:g} s; "
                                       "Ray Data's read tasks may be waiting for CPUs that the workers hold "
                                       "(leave CPUs free on the cluster, or lower cluster.cpus_per_worker)")
                self._cv.wait(min(left, 1.0))
            x, y = self._held[step]
        if parts <= 1:
            return x[lo:hi], y[lo:hi]
        cuts = np.linspace(lo, hi, parts + 1).astype(int)
        return tuple((x[a:b], y[a:b]) for a, b in zip(cuts[:-1], cuts[1:]))

    def _low(self) -> int:
        return next(iter(self._held)) if self._held else self._next

    def _asked_low(self) -> int:
        return self._next + 4 * self.ahead  # further ahead than this: restart rather than read forward

    def _start(self, step: int) -> None:
        self._generation += 1
        self._held.clear()
        self._next = step
        self._asked = step
        self._failed = None
        self._thread = threading.Thread(target=self._produce, args=(step, self._generation), daemon=True,
                                        name=f"gearshift-feeder-{self._generation}")
        self._thread.start()

    def _produce(self, start: int, generation: int) -> None:
        try:
            for step, x, y in self.stream.batches(start):
                with self._cv:
                    while generation == self._generation and step > self._asked + self.ahead:
                        self._cv.wait(1.0)
                    if generation != self._generation:
                        return
                    self._held[step] = (_own(x), _own(y))
                    self._next = step + 1
                    while len(self._held) > 2 * self.ahead + 2 and next(iter(self._held)) < self._asked - self.ahead:
                        self._held.popitem(last=False)
                    self._cv.notify_all()
        except Exception as err:
            with self._cv:
                if generation == self._generation:
                    self._failed = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
                    self._cv.notify_all()


# A rank's slice of a step (a few MB) comes back in pieces small enough that Ray returns each
# inline, in the reply (Ray inlines up to 100 KB), not through the shared object store: store
# pages a worker has mapped count in its memory for as long as it runs, and the store keeps
# handing out fresh ones. A single row larger than a piece still goes through the store.
PIECE_BYTES = 90 << 10
READ_AHEAD_BYTES = 256 << 20


def parts_for(rows: int, row_bytes: int) -> int:
    """How many pieces `rows` rows of `row_bytes` each travel in (see PIECE_BYTES)."""
    return max(1, min(rows, -(-rows * row_bytes // PIECE_BYTES)))


def start_feeder(spec: dict, search_paths: list[str], batch: int, seed: int, cycle: bool, ahead: int,
                 name: str, field: str = "data"):
    """The feeder actor for `spec`, named so the workers find it, on the driver's node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return ray.remote(Feeder).options(
        name=name, num_cpus=0, max_concurrency=64, max_restarts=3, max_task_retries=3,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
    ).remote(spec, list(search_paths), batch, seed, cycle, ahead, field)


# ---------------------------------------------------------------- the worker's side

def _own(a: np.ndarray) -> np.ndarray:
    """`a`, copied when it is a small view of a much larger array (a whole block, when the dataset
    is not shuffled), which holding the view would keep alive; a view of a shuffle window stays."""
    base = a.base if isinstance(a.base, np.ndarray) else None
    return a.copy() if base is not None and base.nbytes > 8 * max(1, a.nbytes) else a


def _joined(got, parts: int) -> tuple[np.ndarray, np.ndarray]:
    if parts == 1:
        return got
    return np.concatenate([x for x, _ in got]), np.concatenate([y for _, y in got])


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, copy=True)) if not a.flags.writeable else torch.from_numpy(a)


class StreamedLoader:
    """This rank's slice of each step from `start` on, `prefetch` steps in flight; the same
    interface as loader.StepLoader."""

    def __init__(self, feeder, start: int, lo: int, hi: int, prefetch: int, row_bytes: int = 0,
                 timeout_s: float = TAKE_TIMEOUT_S + 30):
        self.feeder, self.lo, self.hi, self.timeout_s = feeder, lo, hi, timeout_s
        self.parts = parts_for(hi - lo, row_bytes)
        self.next_step = start
        self._refs: collections.deque = collections.deque()
        self._asked = start
        self.prefetch = max(1, prefetch)
        self._top_up()

    def _take(self, step: int):
        if self.parts == 1:
            return self.feeder.take.remote(step, self.lo, self.hi)
        return self.feeder.take.options(num_returns=self.parts).remote(step, self.lo, self.hi, self.parts)

    def _top_up(self) -> None:
        while len(self._refs) < self.prefetch + 1:
            self._refs.append(self._take(self._asked))
            self._asked += 1

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        import ray

        ref = self._refs.popleft()
        self._top_up()
        x, y = _joined(ray.get(ref, timeout=self.timeout_s), self.parts)
        self.next_step += 1
        return _tensor(x), _tensor(y)

    def close(self) -> None:
        self._refs.clear()


class StreamedData:
    """A streamed dataset as the worker sees it: its length, and loaders over its feeder."""

    def __init__(self, feeder_name: str, batch: int, info: dict | None = None):
        import ray

        self.batch = batch  # the global batch: eval's batches are cut by it too
        self.feeder = ray.get_actor(feeder_name)
        self.info = info or ray.get(self.feeder.describe.remote(), timeout=TAKE_TIMEOUT_S)
        if "error" in self.info:
            e = self.info["error"]
            raise ComponentError(e["field"], e["value"], e["allowed"], e["hint"])
        self.token_targets = self.info["tokens_per_sample"]

    def __len__(self) -> int:
        return int(self.info["rows"])

    def loader(self, start: int, dp_rank: int, dp: int, prefetch: int,
               shares: tuple[int, ...] | None = None) -> StreamedLoader:
        lo, hi = bounds(self.batch, dp_rank, dp, shares)
        return StreamedLoader(self.feeder, start, lo, hi, prefetch, self.info.get("row_bytes", 0))

    def get_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Eval: rows `indices` (contiguous, inside one global batch) of the one pass."""
        import ray

        batch = self.batch
        b = indices[0] // batch
        x, y = ray.get(self.feeder.take.remote(b, indices[0] - b * batch, indices[-1] + 1 - b * batch),
                       timeout=TAKE_TIMEOUT_S + 30)
        return _tensor(x), _tensor(y)
