"""The Ray Serve application behind `gearshift serve`.

    HTTP (Serve's proxy) -> Router (1 replica: validation, version choice, admin)
                              -> Replica deployment "stable" (N replicas)  \\ adaptive batching,
                              -> Replica deployment "canary" (N replicas)  /  warmed up first
    Ledger (a named actor): every batch's size, queue wait and latency, per version

**Batching.** A replica's `predict_batch` is a `@serve.batch` method: requests that arrive within
`batch_wait_ms` of the first one (up to `max_batch` requests) run as one forward, their rows
concatenated. A request marked `"priority": "latency"` goes to `predict_now` instead and runs at
once, alone, without waiting for a window to close.

**Warm-up.** A replica's constructor loads the artifact and runs a few forwards at batch 1 and at
the largest batch before it returns; Serve sends a replica no traffic before its constructor has
returned, so no request pays for a cold model. `/healthz` answers 200 once every deployment is
up.

**Versions.** With a canary, the router sends each request to the canary with probability
`canary_share`, else to the stable version; `promote` sets the share to 1 (all traffic to the
canary), `rollback` to 0. Every answer names the version that computed it.

**Requests.** `POST /predict` with `{"inputs": [[...], ...]}` (one row per sample, each row of the
model's input shape) or `{"inputs_b64": "...", "shape": [n, ...], "dtype": "float32"}` (the
rows' raw little-endian bytes). Bad requests get a 4xx with one sentence saying what was wrong
and what the model takes; nothing a request sends can stop the server.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import random
import time

import numpy as np
from ray import serve

BATCH_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MS_BOUNDARIES = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
LEDGER = "gearshift-serve-ledger"


class BadRequest(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_inputs(payload, sample_shape: tuple, dtype: str) -> np.ndarray:
    """The request's rows as one array of shape (n, *sample_shape) and the model's dtype."""
    if not isinstance(payload, dict):
        raise BadRequest(400, f"the body must be a JSON object with \"inputs\", got {type(payload).__name__}")
    want = np.dtype(dtype)
    shape_text = f"rows of shape {list(sample_shape)} of {dtype}"
    if "inputs_b64" in payload:
        shape, got = payload.get("shape"), payload.get("dtype", dtype)
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise BadRequest(400, "\"inputs_b64\" needs \"shape\": a list of sizes, the number of rows first")
        if got != dtype:
            raise BadRequest(400, f"\"dtype\" {got!r} is not the model's: it takes {dtype}")
        try:
            raw = base64.b64decode(payload["inputs_b64"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise BadRequest(400, "\"inputs_b64\" is not valid base64") from None
        if len(raw) != int(np.prod(shape)) * want.itemsize:
            raise BadRequest(400, f"\"inputs_b64\" holds {len(raw)} bytes; shape {shape} of {dtype} needs "
                                  f"{int(np.prod(shape)) * want.itemsize}")
        x = np.frombuffer(raw, dtype=want.newbyteorder("<")).astype(want).reshape(shape)
    else:
        if "inputs" not in payload:
            raise BadRequest(400, f"the body has no \"inputs\" (keys: {', '.join(map(str, payload)) or 'none'}); "
                                  f"send {{\"inputs\": [...]}} with {shape_text}")
        rows = payload["inputs"]
        if not isinstance(rows, list) or not rows:
            raise BadRequest(400, f"\"inputs\" must be a non-empty list of {shape_text}")
        try:
            x = np.array(rows)
        except ValueError:
            raise BadRequest(400, f"\"inputs\" is not rectangular: every row must be {shape_text}") from None
        if x.dtype == object:
            raise BadRequest(400, f"\"inputs\" is not rectangular: every row must be {shape_text}")
        if x.dtype.kind not in "biuf":
            raise BadRequest(400, f"\"inputs\" holds {x.dtype.kind == 'U' and 'strings' or x.dtype}; the model "
                                  f"takes numbers ({dtype})")
        if want.kind in "iu" and x.dtype.kind == "f":
            if not np.all(np.isfinite(x)) or not np.all(x == np.round(x)):
                raise BadRequest(400, f"\"inputs\" holds fractional numbers; the model takes integers ({dtype})")
        x = x.astype(want)
    if tuple(x.shape[1:]) != tuple(sample_shape):
        raise BadRequest(400, f"\"inputs\" has rows of shape {list(x.shape[1:])}; the model takes {shape_text}")
    if x.shape[0] == 0:
        raise BadRequest(400, "\"inputs\" has no rows")
    return np.ascontiguousarray(x)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Router:
    def __init__(self, stable, canary, canary_share: float, max_request_bytes: int, admin_token: str, info: dict):
        self.handles = {"stable": stable, "canary": canary}
        self.share = float(canary_share) if canary is not None else 0.0
        self.max_bytes = int(max_request_bytes)
        self.token = admin_token
        self.info = info  # {"stable": {version, input_shape, input_dtype}, "canary": ...}
        self.random = random.Random()

    def _pick(self) -> str:
        if self.handles["canary"] is None:
            return "stable"
        return "canary" if self.random.random() < self.share else "stable"

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        path, method = request.url.path.rstrip("/") or "/", request.method
        try:
            if path == "/healthz" and method == "GET":
                return JSONResponse({"ready": True, "versions": self._versions(), "canary_share": self.share})
            if path == "/predict" and method == "POST":
                return JSONResponse(await self._predict(request))
            if path in ("/admin/promote", "/admin/rollback") and method == "POST":
                return JSONResponse(self._admin(request, path.rsplit("/", 1)[1]))
            if path == "/stats" and method == "GET":
                ledger = _ledger()
                return JSONResponse({"versions": self._versions(), "canary_share": self.share,
                                     "batches": await ledger.summary.remote() if ledger else {}})
            allowed = "GET /healthz, POST /predict, GET /stats, POST /admin/promote, POST /admin/rollback"
            raise BadRequest(404, f"{method} {path} is not served here; this server answers {allowed}")
        except BadRequest as err:
            return JSONResponse({"error": str(err)}, status_code=err.status)

    def _versions(self) -> dict:
        return {k: v["version"] for k, v in self.info.items() if v}

    def _admin(self, request, action: str) -> dict:
        if request.headers.get("x-gearshift-token") != self.token:
            raise BadRequest(403, "this admin call needs the token `gearshift serve` wrote to its state file")
        if self.handles["canary"] is None:
            raise BadRequest(409, f"there is no canary to {action}: start the server with --canary NEW")
        self.share = 1.0 if action == "promote" else 0.0
        return {"canary_share": self.share, "versions": self._versions(),
                "serving": self.info["canary" if action == "promote" else "stable"]["version"]}

    async def _predict(self, request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            raise BadRequest(413, f"the request is {int(length)} bytes; this server takes at most {self.max_bytes} "
                                  "(--max-request-mb)")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_bytes:
                raise BadRequest(413, f"the request is over {self.max_bytes} bytes, the most this server takes "
                                      "(--max-request-mb)")
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as err:
            raise BadRequest(400, f"the body is not valid JSON ({err})") from None
        which = self._pick()
        info = self.info[which]
        x = parse_inputs(payload, tuple(info["input_shape"]), info["input_dtype"])
        priority = payload.get("priority", "throughput") if isinstance(payload, dict) else "throughput"
        if priority not in ("latency", "throughput"):
            raise BadRequest(400, f"\"priority\" {priority!r} is not valid: latency (run at once) or throughput "
                                  "(batched, the default)")
        handle = self.handles[which]
        out = await (handle.predict_now if priority == "latency" else handle.predict).remote(x)
        return {"outputs": out.tolist(), "version": info["version"]}


@serve.deployment
class Replica:
    def __init__(self, artifact: str, version: str | None, max_batch: int, batch_wait_ms: float, threads: int,
                 warmup: int = 3):
        import torch

        from gearshift.serving.artifact import open_artifact

        torch.set_num_threads(max(1, threads))
        if isinstance(artifact, (bytes, bytearray)):  # shipped by the driver: no shared disk needed
            import tempfile

            # read whole when opened (an ONNX session, a torch.export program): the file goes at
            # once, not with the replica's process (Serve ends it without running finalizers)
            with tempfile.NamedTemporaryFile(prefix="gearshift-serve-", suffix=".model") as file:
                file.write(artifact)
                file.flush()
                self.runtime = open_artifact(file.name, threads)
        else:
            self.runtime = open_artifact(artifact, threads)
        self.version = version or self.runtime.version
        self.predict_batch.set_max_batch_size(max_batch)
        self.predict_batch.set_batch_wait_timeout_s(batch_wait_ms / 1000.0)
        self.dtype = self.runtime.dtype
        shape = self.runtime.sample_shape
        for n in sorted({1, max_batch}):  # warm-up: the model's first calls are the slow ones
            for _ in range(warmup):
                self.runtime(torch.zeros((n, *shape), dtype=self.dtype))
        self.ledger = _ledger()
        self._metrics()

    def _metrics(self) -> None:
        from ray.serve import metrics

        tags = ("version",)
        self.m_batch = metrics.Histogram("gearshift_serve_batch_size", "requests per forward",
                                         boundaries=BATCH_BOUNDARIES, tag_keys=tags)
        self.m_wait = metrics.Histogram("gearshift_serve_queue_wait_ms", "ms a request waited for its batch",
                                        boundaries=MS_BOUNDARIES, tag_keys=tags)
        self.m_forward = metrics.Histogram("gearshift_serve_forward_ms", "ms of one forward",
                                           boundaries=MS_BOUNDARIES, tag_keys=tags)
        for m in (self.m_batch, self.m_wait, self.m_forward):
            m.set_default_tags({"version": self.version})

    def _forward(self, x: np.ndarray) -> np.ndarray:
        import torch

        return self.runtime(torch.from_numpy(np.require(x, requirements="W"))).numpy()  # Ray's are read-only

    async def predict_now(self, x: np.ndarray) -> np.ndarray:
        t = time.perf_counter()
        out = self._forward(x)
        self._record(1, 0.0, (time.perf_counter() - t) * 1e3, "latency")
        return out

    async def predict(self, x: np.ndarray) -> np.ndarray:
        """Batched: waits up to the batch window for other requests (queue wait counted from here)."""
        return await self.predict_batch((x, time.perf_counter()))

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def predict_batch(self, items: list) -> list:
        started = time.perf_counter()
        rows = [x for x, _ in items]
        sizes = [len(x) for x in rows]
        out = self._forward(np.concatenate(rows) if len(rows) > 1 else rows[0])
        forward_ms = (time.perf_counter() - started) * 1e3
        wait_ms = max((started - t0) * 1e3 for _, t0 in items)
        self._record(len(items), wait_ms, forward_ms, "batch")
        return list(np.split(out, np.cumsum(sizes)[:-1]))

    def _record(self, size: int, wait_ms: float, forward_ms: float, kind: str) -> None:
        self.m_batch.observe(size)
        self.m_wait.observe(wait_ms)
        self.m_forward.observe(forward_ms)
        if self.ledger is not None:
            self.ledger.record.remote(self.version, kind, size, wait_ms, forward_ms)

    async def ready(self) -> dict:
        await asyncio.sleep(0)
        return {"version": self.version}


def _ledger():
    import ray

    try:
        return ray.get_actor(LEDGER, namespace="serve")
    except ValueError:
        return None


class Ledger:
    """Counts per version: how many forwards of each batch size (requests per forward), and the
    latency-priority forwards apart."""

    def __init__(self):
        self.counts: dict = {}

    def record(self, version: str, kind: str, size: int, wait_ms: float, forward_ms: float) -> None:
        v = self.counts.setdefault(version, {"batch": {}, "latency": 0, "requests": 0, "max_wait_ms": 0.0})
        if kind == "latency":
            v["latency"] += 1
        else:
            v["batch"][str(size)] = v["batch"].get(str(size), 0) + 1
            v["max_wait_ms"] = max(v["max_wait_ms"], wait_ms)
        v["requests"] += size

    def summary(self) -> dict:
        return self.counts


def application(stable: dict, canary: dict | None, replicas: int, max_batch: int, batch_wait_ms: float,
                threads: int, canary_share: float, max_request_bytes: int, admin_token: str):
    """The Serve application: `stable` and `canary` are {artifact, version, input_shape,
    input_dtype}."""
    import ray

    ray.remote(num_cpus=0)(Ledger).options(name=LEDGER, namespace="serve", lifetime="detached",
                                           get_if_exists=True).remote()
    # A replica takes as many requests at once as two batches hold (so that a batch can fill while one
    # runs), and at least 64: requests past a replica's limit wait in Serve's router, which backs off
    # and probes again (measured: 64 clients on an unbatched replica limited to 8 got 7 requests/s with
    # 10 s at the median), while requests held by the replica wait in its own queue, in order
    opts = {"num_replicas": replicas, "ray_actor_options": {"num_cpus": threads},
            "max_ongoing_requests": max(2 * max_batch, 64)}
    one = Replica.options(name="stable", **opts).bind(stable["artifact"], stable["version"], max_batch,
                                                      batch_wait_ms, threads)
    two = (Replica.options(name="canary", **opts).bind(canary["artifact"], canary["version"], max_batch,
                                                       batch_wait_ms, threads) if canary else None)
    info = {"stable": _public(stable), "canary": _public(canary) if canary else None}
    return Router.options(num_replicas=1, max_ongoing_requests=4096).bind(one, two, canary_share, max_request_bytes, admin_token, info)


def _public(v: dict) -> dict:
    return {k: v[k] for k in ("version", "input_shape", "input_dtype")}
