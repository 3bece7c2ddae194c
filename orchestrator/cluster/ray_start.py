"""Starting an embedded Ray or joining a cluster, for the length of a run: `ray_session`. An
address that nothing answers fails in seconds (`check_reachable`); a start Ray says timed out is
tried once more; every failure is one paragraph (what failed, what to try), never Ray's traceback.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket

from gearshift.orchestrator.errors import GearshiftError, UsageError
from gearshift.orchestrator.control.startup import STARTUP

log = logging.getLogger("gearshift")


class _QuietTokenNotice(logging.Filter):
    """Ray logs a notice on every start that token auth is on. gearshift keeps it on (it is what
    protects the cluster), so the notice tells a gearshift user nothing and is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Token authentication is enabled" not in record.getMessage()


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, not after Ray's minutes of retries, when nothing listens at `address`."""
    if address in ("auto", "local"):
        return
    if address.startswith(("http://", "https://")):
        raise UsageError(f"--address {address} is a dashboard URL, which `gearshift submit` takes. "
                         "`gearshift run` joins a cluster by its GCS address, e.g. 10.0.0.1:6379, or 'auto' "
                         "on a cluster node.")
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--address {address!r} is not host:port (e.g. 10.0.0.1:6379) or 'auto'.")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise GearshiftError(f"Nothing answers at Ray address {address} ({err.strerror or err}). Check that the "
                             "head is running (`ray status` on it) and that the address is its GCS host:port "
                             "(port 6379 by default).") from None


def start_ray(address: str | None, num_cpus: int | None) -> None:
    """ray.init: join `address`, or start an embedded Ray; GearshiftError when neither works. An
    embedded start that Ray says timed out (its processes slow to come up on a loaded machine)
    is tried once more."""
    for name in ("ray", "ray._private.authentication.authentication_token_setup"):
        logging.getLogger(name).addFilter(_QuietTokenNotice())
    where = address or "a new local cluster"
    for attempt in (1, 2):
        try:
            _init(address, num_cpus)
            return
        except (ConnectionError, RuntimeError, ValueError) as err:
            _shutdown()
            raise GearshiftError(f"Could not start or join Ray at {where}: {str(err).splitlines()[0]}. Check the "
                                 "address (host:port of the head's GCS, e.g. 10.0.0.1:6379, or 'auto') and that the "
                                 "head is running.") from None
        except Exception as err:  # noqa: BLE001 - Ray's own, e.g. "The current node timed out during startup"
            _shutdown()
            text = (str(err).splitlines() or [type(err).__name__])[0]
            if attempt == 1 and not address and "timed out" in text:
                continue
            raise GearshiftError(f"Ray did not start at {where}: {text}"
                                 + (" (tried twice)" if attempt == 2 else "") + ". On a busy machine, stop what "
                                 "else is running or ask for fewer workers (cluster.num_workers) and CPUs each "
                                 "(cluster.cpus_per_worker); or start Ray yourself (`ray start --head`) and give its "
                                 "address with --address (gearshift.run(..., address=...)).") from None
        except BaseException:  # Ctrl-C while Ray starts: stop what has started
            _shutdown()
            raise


def _init(address: str | None, num_cpus: int | None) -> None:
    import ray

    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    else:
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=True)


def _shutdown() -> None:
    import ray

    with contextlib.suppress(Exception):
        ray.shutdown()


@contextlib.contextmanager
def ray_session(address: str | None, num_cpus: int | None = None):
    """Join `address` (or RAY_ADDRESS) if given, else start an embedded Ray sized to this machine.
    Ray is shut down on exit either way (for a joined cluster that only disconnects)."""
    import ray

    if ray.is_initialized():  # someone (a test, a notebook) already connected: use theirs, leave it up
        yield {"address": "existing", "embedded": False}
        return
    else:
        address = address or os.environ.get("RAY_ADDRESS") or None
        start_ray(address, num_cpus)
    STARTUP.mark("ray")
    try:
        yield {"address": address or "local", "embedded": not address}
    finally:
        gc.collect()  # Ray refs held in reference cycles, freed now while Ray is up (after it they can crash the exit)
        if not address:
            _stop_autoscaler_monitor()
        ray.shutdown()


def _stop_autoscaler_monitor() -> None:
    """Kill an embedded Ray's autoscaler monitor before ray.shutdown. Ray stops its GCS first,
    and the monitor, told to stop after that, spends Ray's whole grace period (1 s, on every run)
    failing to reach it; an embedded cluster has nothing to scale, and what is left of it ends
    a moment later. Ray's own record of its processes is private, so anything unexpected there
    leaves the stopping to ray.shutdown, as before."""
    try:
        from ray._private import ray_constants, worker

        node = worker._global_node
        monitors = node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []) if node else []
        for info in monitors:
            info.process.kill()
            info.process.wait(timeout=5)
    except Exception as err:  # noqa: BLE001  (a Ray whose internals moved: ray.shutdown stops it)
        log.debug("could not stop the autoscaler monitor first: %s", err)
