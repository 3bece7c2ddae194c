"""`gearshift serve EXPORT_OR_RUN`: a model behind an HTTP endpoint on Ray Serve, with adaptive
batching, warm-up and an optional canary version (serving/server.py); `gearshift serve promote`
and `gearshift serve rollback` move a running server's traffic.

The server runs until Ctrl-C or SIGTERM, then stops what it started: its Serve application, and
the embedded Ray when it started one. It writes a state file (the URL and an admin token, readable
by its user alone) that `promote`, `rollback` and `status` read; the file goes when it stops.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import signal
import sys
import time
import urllib.error
import urllib.request

from gearshift.orchestrator.errors import UsageError

ACTIONS = ("promote", "rollback", "status")
APP = "gearshift"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an exported model (or a run's) over HTTP on Ray Serve, with adaptive "
                                     "batching and a canary; `serve promote|rollback|status` steer a running one")
    p.add_argument("model", metavar="EXPORT_OR_RUN|promote|rollback|status",
                   help="a file `gearshift export --format onnx|torch-export` wrote, or a run (its final model, "
                        "eager); or an action on the running server")
    p.add_argument("--replicas", type=int, default=1, help="replicas of each version (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this "
                                                        "machine only)")
    p.add_argument("--port", type=int, default=8000, help="the HTTP port (default 8000)")
    p.add_argument("--max-batch", type=int, default=32, help="requests batched into one forward at most (default 32)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long a batch waits to fill after its first request (default 5 ms)")
    p.add_argument("--max-request-mb", type=float, default=16.0, help="the largest request body (default 16 MB)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (and Ray CPUs) per replica (default 1)")
    p.add_argument("--canary", metavar="NEW", help="a second version (an export or a run) that takes "
                                                   "--canary-share of the traffic")
    p.add_argument("--canary-share", type=float, default=0.05, help="the canary's share of requests (default 0.05)")
    p.add_argument("--address", help="serve on this Ray cluster (default: RAY_ADDRESS, else an embedded Ray)")
    p.add_argument("--metrics-port", type=int, help="embedded Ray: the port of Ray's Prometheus endpoint, where "
                                                    "Serve's metrics and gearshift_serve_* go")
    p.add_argument("--state", default=".gearshift-serve.json",
                   help="the running server's state file (URL, admin token); default ./.gearshift-serve.json")


def cmd_serve(args) -> int:
    if args.model in ACTIONS:
        return _action(args)
    _check_args(args)
    stable = _version(args.model, "the model")
    canary = _version(args.canary, "--canary") if args.canary else None
    if canary and canary["version"] == stable["version"]:
        canary["version"] += "-canary"
    state = pathlib.Path(args.state)
    _refuse_a_second_server(state)
    import ray
    from ray import serve

    from gearshift.serving import server

    started_ray = _start_ray(args, canary) if not ray.is_initialized() else False
    try:
        return _serve_until_stopped(args, stable, canary, state, serve, server)
    finally:
        _stop(state, started_ray, serve)


def _refuse_a_second_server(state: pathlib.Path) -> None:
    if state.exists():
        other = _read_state(state)
        if other and _alive(other.get("pid")):
            raise UsageError(f"{state} says a server (pid {other['pid']}) is running at {other.get('url')}; stop it "
                             "first, or give this one another --state file")


def _start_ray(args, canary: dict | None) -> bool:
    """Join --address (or RAY_ADDRESS), else start a Ray here with a CPU for every replica thread."""
    import ray

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level="WARNING")
    else:
        # a replica on a busy 2-core machine may take more than Serve's 0.1 s to say its queue length
        os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0")
        need = args.replicas * args.threads * (2 if canary else 1) + 1
        kwargs = {"_metrics_export_port": args.metrics_port} if args.metrics_port else {}
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
                 logging_level="WARNING", **kwargs)
    # Ray's core installs a C++ SIGTERM handler that prints a stack; stop as for Ctrl-C instead
    signal.signal(signal.SIGTERM, _terminated)
    return True


def _serve_until_stopped(args, stable: dict, canary: dict | None, state: pathlib.Path, serve, server) -> int:
    """Start the application (`server`'s, on Ray `serve`), write the state file once it answers,
    and serve until Ctrl-C or SIGTERM."""
    token = secrets.token_hex(16)
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    try:
        say(f"gearshift serve: starting {stable['version']}" + (f" and canary {canary['version']} "
                                                                f"({args.canary_share:.0%})" if canary else "")
            + f" on Ray Serve; each replica warms up before it takes traffic")
        t0 = time.monotonic()
        quiet = {"log_level": "WARNING", "enable_access_log": False}  # Serve's per-request lines: --verbose
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config=quiet)
        app = server.application(stable, canary, args.replicas, args.max_batch, args.batch_wait_ms, args.threads,
                                 args.canary_share, int(args.max_request_mb * (1 << 20)), token)
        serve.run(app, name=APP, route_prefix="/", blocking=False, logging_config=quiet)
        _wait_ready(url, 120)
        _write_state(state, {"url": url, "token": token, "pid": os.getpid(), "stable": stable["version"],
                             "canary": canary["version"] if canary else None})
        say(f"gearshift serve: ready in {time.monotonic() - t0:.1f} s at {url}/predict (POST {{\"inputs\": [...]}}), "
            f"{url}/healthz, {url}/stats; Ctrl-C stops it")
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        say("gearshift serve: stopping")
        return 0


def _stop(state: pathlib.Path, started_ray: bool, serve) -> None:
    """The state file (if this server wrote it), the application, Serve, and a Ray this command started."""
    import ray

    if state.exists() and (_read_state(state) or {}).get("pid") == os.getpid():
        state.unlink()
    try:
        serve.delete(APP)
        serve.shutdown()
    except Exception:  # noqa: BLE001 - Ray may be gone already; stopping must go on
        pass
    if started_ray:
        ray.shutdown()


def _terminated(signum, frame):
    raise KeyboardInterrupt("SIGTERM")


def _check_args(args) -> None:
    for flag, value, lo in (("--replicas", args.replicas, 1), ("--max-batch", args.max_batch, 1),
                            ("--threads", args.threads, 1), ("--port", args.port, 1)):
        if value < lo:
            raise UsageError(f"{flag} {value} is not valid: give {lo} or more")
    if args.port > 65535:
        raise UsageError(f"--port {args.port} is not valid: give 1..65535")
    if not 0 <= args.batch_wait_ms <= 10_000:
        raise UsageError(f"--batch-wait-ms {args.batch_wait_ms} is not valid: give 0..10000")
    if not 0 < args.max_request_mb <= 1024:
        raise UsageError(f"--max-request-mb {args.max_request_mb} is not valid: give more than 0, at most 1024")
    if not 0 <= args.canary_share <= 1:
        raise UsageError(f"--canary-share {args.canary_share} is not valid: give a share between 0 and 1")
    if args.canary_share != 0.05 and not args.canary:
        raise UsageError("--canary-share needs --canary NEW: the version that takes that share")
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds: past TIME_WAIT
        try:
            s.bind((args.host, args.port))
        except OSError as err:
            raise UsageError(f"--port {args.port} on {args.host} cannot be listened on ({err.strerror}); give a "
                             "free port") from None


def _version(target: str, what: str) -> dict:
    """{artifact (bytes of an export, or a run's path), version, input_shape, input_dtype}."""
    from gearshift.serving import artifact

    path = pathlib.Path(target)
    if not path.is_file():  # a run: its directory, or a fingerprint `gearshift runs` lists
        if not path.exists() and ("/" in target or "." in path.name):
            raise UsageError(f"{what} {target}: no such file or run directory")
        from gearshift.orchestrator.commands.runs import find_run

        path = find_run(target).path
        target = str(path)
    runtime = artifact.open_artifact(target)
    if not runtime.sample_shape and not runtime.record:
        raise UsageError(f"{what} {target} carries no gearshift record (input shape, dtype); export it with "
                         "`gearshift export RUN --format onnx` or `--format torch-export`")
    ref = path.read_bytes() if path.is_file() else str(path.resolve()) if path.exists() else target
    return {"artifact": ref, "version": runtime.version, "input_shape": list(runtime.sample_shape),
            "input_dtype": str(runtime.dtype).replace("torch.", "")}


def _wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise UsageError(f"the server did not answer {url}/healthz within {timeout_s:.0f} s")
        time.sleep(0.25)


def _write_state(path: pathlib.Path, state: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def _read_state(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _action(args) -> int:
    state = _read_state(pathlib.Path(args.state))
    if not state or not _alive(state.get("pid")):
        raise UsageError(f"no running server: {args.state} is missing or names a process that is gone (start one "
                         "with `gearshift serve EXPORT`, or give its --state file)")
    if args.model == "status":
        req = urllib.request.Request(f"{state['url']}/stats")
    else:
        req = urllib.request.Request(f"{state['url']}/admin/{args.model}", data=b"{}", method="POST",
                                     headers={"x-gearshift-token": state["token"]})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as err:
        raise UsageError(f"the server refused {args.model}: {json.loads(err.read() or b'{}').get('error', err)}") from None
    except (urllib.error.URLError, OSError) as err:
        raise UsageError(f"the server at {state['url']} did not answer ({err})") from None
    if args.model == "status":
        print(json.dumps(answer, indent=1))
    else:
        print(f"gearshift serve: {args.model}: all traffic to {answer['serving']} "
              f"(canary share {answer['canary_share']:.0%})", file=sys.stderr)
    return 0
