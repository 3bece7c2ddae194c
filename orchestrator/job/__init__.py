"""The job file: YAML in, frozen dataclasses out, or a JobError that names the field.

`load_job(path, overrides)` is the only way a job enters gearshift. The parts: `fields` (one
checker per value), `spec` (the dataclasses), `load` (YAML, overrides, `load_job`), `checks`
(rules between fields and against the code a job names), `schema` (the JSON Schema for editors).
"""

from gearshift.orchestrator.job.checks import accumulation, check_job, scheduled
from gearshift.orchestrator.job.fields import BUILTIN_STRATEGIES, JobError
from gearshift.orchestrator.job.load import (apply_overrides, dump_job, job_from_dict, load_job, override_pairs,
                                            parse_overrides, read_yaml)
from gearshift.orchestrator.job.spec import Job

__all__ = ["BUILTIN_STRATEGIES", "Job", "JobError", "accumulation", "apply_overrides", "check_job", "dump_job",
           "job_from_dict", "load_job", "override_pairs", "parse_overrides", "read_yaml", "scheduled"]
