"""What the driver reads and writes over a checkpointed run, against what the checkpoints hold.

`gearshift.run` of the built-in GPT under fsdp(4) (about 170M parameters: n_layer 12, n_embd
1024, vocab 16384, Adam, so a checkpoint holds three fp32 copies of the parameters), checkpointing
every `--every` steps, in this process, so that this process is the driver. Its /proc/self/io is
read before and after the run: `rchar`/`wchar` count every byte its read and write calls moved
(files, and its sockets to Ray and the workers: an upper bound on what it read of the
checkpoints), `read_bytes`/`write_bytes` what reached the disk. The figures are divided by the
bytes of every checkpoint the run committed (their manifests' sums), over the part of the run from
its first step's end to its `done` record (sampled every 50 ms): start-up, which reads the
interpreter's modules and Ray's files, is reported apart (`whole_run_...`).

Two variants, alternating, `--repeats` times each: `checkpoint.final: none` (the driver commits
manifests and nothing else) and `auto` (a model under 2 GiB in fp32 also gets final.pt, written out
of the last checkpoint by rank 0, or by the driver where rank 0 does not see the run's folder).

    python bench/driver_io.py            # the 170M GPT, 8 steps, a checkpoint every 2; 2 repeats
    python bench/driver_io.py --quick    # a 25M GPT, 4 steps; 1 repeat (about 3 min on 2 cores)
    python bench/driver_io.py --smoke    # final none, a 0.1M GPT, 2 steps, a checkpoint each: that it runs (CI)

Measured (full mode, 1 repeat, 2-core CPU machine, 2026-12-04): over 8474 MiB of checkpoints (4
of them), from the first step to the end the driver read 0.2 MiB and wrote 0.1 MiB with final
none (2.4e-05 and 1.5e-05 of the checkpoints' bytes), and the same with auto (2.5e-05 and
1.4e-05), whose 705 MiB final.pt rank 0 wrote from the last checkpoint on its node. The whole run,
start-up included, read 108 MiB (0.013; the first run in the process, which reads the
interpreter's modules) and 44 MiB (0.005). --quick (25M GPT, 484 MiB of checkpoints): 1.8e-05 /
2.3e-05 with none, 2.4e-05 / 2.8e-05 with auto (an 80 MiB final.pt).

The last line is one JSON object: per variant the medians (with min and max) of
`driver_rchar_over_checkpoint_bytes` and `driver_wchar_over_checkpoint_bytes`, the goal being
<= 0.01 with final none.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _io() -> dict[str, int]:
    out = {}
    for line in pathlib.Path("/proc/self/io").read_text().splitlines():
        key, value = line.split(":")
        out[key] = int(value)
    return out


def _checkpoint_bytes(run_dir: pathlib.Path) -> int:
    total = 0
    for manifest in (run_dir / "checkpoints").glob("step_*/manifest.json"):
        total += sum(f["bytes"] for f in json.loads(manifest.read_text())["files"].values())
    return total


class Sampler(threading.Thread):
    """/proc/self/io every 50 ms with the time, so that the run's own records can say which part
    of the driver's reading fell between its first step and its end (start-up reads the
    interpreter's modules and Ray's files; none of that is checkpoint data)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, dict]] = []
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(0.05):
            self.samples.append((time.time(), _io()))

    def at(self, when: float) -> dict:
        return min(self.samples, key=lambda s: abs(s[0] - when))[1]


def _window(run_dir: pathlib.Path) -> tuple[float, float]:
    """From the end of the first step to the `done` state record."""
    records = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    first = min(r.get("ended_at") or r["time"] for r in records if r["type"] == "step")
    done = next(r["time"] for r in records if r.get("event") == "state" and r.get("state") == "done")
    return first, done


def one_run(model: dict, steps: int, every: int, final: str, where: pathlib.Path) -> dict:
    import gearshift

    job = {"name": "driver-io", "model": {"name": "gpt", "kwargs": model}, "data": "chars",
           "optimizer": {"name": "adamw", "lr": 1e-4},
           "train": {"steps": steps, "global_batch_size": 4, "log_every": 1000},
           "cluster": {"num_workers": 4, "cpus_per_worker": 0.5},
           "parallel": {"strategy": "fsdp"},
           "checkpoint": {"every": every, "keep": steps, "final": final, "async_save": False},
           "telemetry": {"ray_metrics": False}}
    sampler = Sampler()
    before = _io()
    sampler.start()
    result = gearshift.run(job, run_dir=where)
    sampler.done.set()
    sampler.join(5)
    after = _io()
    moved = {k: after[k] - before[k] for k in ("rchar", "wchar", "read_bytes", "write_bytes")}
    first, done = _window(result.run_dir)
    a, b = sampler.at(first), sampler.at(done)
    size = _checkpoint_bytes(result.run_dir)
    final_pt = result.run_dir / "final.pt"
    return {**moved, "checkpoint_bytes": size, "final_pt_bytes": final_pt.stat().st_size if final_pt.exists() else 0,
            "training_rchar": b["rchar"] - a["rchar"], "training_wchar": b["wchar"] - a["wchar"],
            "rchar_over": (b["rchar"] - a["rchar"]) / size, "wchar_over": (b["wchar"] - a["wchar"]) / size,
            "whole_run_rchar_over": moved["rchar"] / size}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--smoke", action="store_true", help="final none only, a 0.1M-parameter GPT, 2 steps, 1 "
                        "repeat: that the bench runs")
    args = parser.parse_args()
    if args.smoke:
        model, steps, every, repeats = ({"vocab_size": 256, "block_size": 16, "n_layer": 1, "n_head": 2,
                                         "n_embd": 64}, 2, 1, args.repeats or 1)
    elif args.quick:
        model, steps, every, repeats = ({"vocab_size": 8192, "block_size": 64, "n_layer": 4, "n_head": 8,
                                         "n_embd": 512}, 4, 2, args.repeats or 1)
    else:
        model, steps, every, repeats = ({"vocab_size": 16384, "block_size": 64, "n_layer": 12, "n_head": 16,
                                         "n_embd": 1024}, 8, 2, args.repeats or 2)
    runs: dict[str, list[dict]] = {"none": []} if args.smoke else {"none": [], "auto": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for final in runs:  # alternating: the machine drifts
                got = one_run(model, steps, every, final, pathlib.Path(tmp) / f"{final}-{r}")
                runs[final].append(got)
                print(f"final {final:4s} repeat {r}: from the first step to the end the driver read "
                      f"{got['training_rchar'] / 2**20:7.1f} MiB and wrote {got['training_wchar'] / 2**20:7.1f} MiB "
                      f"over {got['checkpoint_bytes'] / 2**20:.0f} MiB of checkpoints: {got['rchar_over']:.4f} / "
                      f"{got['wchar_over']:.4f} (the whole run, start-up included: {got['rchar'] / 2**20:.1f} MiB "
                      f"read, {got['wchar'] / 2**20:.1f} written; disk {got['read_bytes'] / 2**20:.1f} / "
                      f"{got['write_bytes'] / 2**20:.1f})"
                      + (f"; final.pt {got['final_pt_bytes'] / 2**20:.0f} MiB" if got["final_pt_bytes"] else ""),
                      flush=True)
    figures = {f"final_{k}": {"driver_rchar_over_checkpoint_bytes": _spread([g["rchar_over"] for g in v]),
                              "driver_wchar_over_checkpoint_bytes": _spread([g["wchar_over"] for g in v]),
                              "whole_run_driver_rchar_over_checkpoint_bytes":
                                  _spread([g["whole_run_rchar_over"] for g in v]),
                              "checkpoint_bytes": v[0]["checkpoint_bytes"], "final_pt_bytes": v[0]["final_pt_bytes"]}
               for k, v in runs.items()}
    print(json.dumps({"model": model, "steps": steps, "every": every, "repeats": repeats, **figures}))


if __name__ == "__main__":
    main()
