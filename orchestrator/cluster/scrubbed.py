"""A worker group as the controller holds it: what its workers send, scrubbed of the run's secrets.

A worker's text reaches the driver through its group only: the results of calls, the step loop's
reports (a dropped step's error, a build's reason, a switch that could not allocate), and the
failures (a worker's exception with its traceback, why a process died). What a worker's code
said may hold a secret the run was given: fsspec names the storage URL with its password, a
library echoes a token. The driver writes these texts to the run dir (gearshift.log, telemetry,
summary.json), to trackers and the terminal, and raises them to the user; so `ScrubbedGroup`
stands between the group and the controller, and every result, report and exception passes
through the run's `Scrubber` (orchestrator/job/secrets.py) before the driver sees it. The
controller wraps whatever group its factory makes (RayWorkerGroup, or a test's own), so no path
from a worker to the driver goes around it.

The group it wraps is called as it is: a method the group lacks is lacking here too (the
controller asks `hasattr` of the optional ones), an attribute set here is set on the group (a
callback such as `choose_layout` takes its arguments scrubbed), and `put` (the driver's own value,
on its way to the workers) is left alone.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator

from gearshift.orchestrator.job.secrets import Scrubber

_DRIVER_SIDE = frozenset({"put"})  # what the driver sends: nothing of a worker's in it


class ScrubbedGroup:
    def __init__(self, group: Any, scrub: Scrubber):
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "scrub", scrub)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.group, name)
        if name in _DRIVER_SIDE:
            return attr
        if not callable(attr):
            return self.scrub.value(attr)

        def scrubbed(*args, **kwargs):
            try:
                result = attr(*args, **kwargs)
            except Exception as err:
                self.scrub.error(err)
                raise
            return self._stream(result) if inspect.isgenerator(result) else self.scrub.value(result)

        scrubbed.__name__ = scrubbed.__qualname__ = name
        return scrubbed

    def __setattr__(self, name: str, value: Any) -> None:
        if callable(value):  # a callback the group calls with what its workers said
            def called(*args, _fn=value):
                return _fn(*(self.scrub.value(a) for a in args))

            setattr(self.group, name, called)
        else:
            setattr(self.group, name, value)

    def _stream(self, reports: Iterator) -> Iterator:
        """A stream of reports (`train`), each scrubbed, and its failure too; closed with this one."""
        try:
            for item in reports:
                yield self.scrub.value(item)
        except Exception as err:
            self.scrub.error(err)
            raise
        finally:
            reports.close()
