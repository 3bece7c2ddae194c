"""What dropout masks per sample cost: a training step with `train.random_per: sample` (each
nn.Dropout a SampleDropout, workers/step/sample_masks.py) against torch's own dropout
(`replica`), side by side in one process.

The model is a small GPT-2 (transformers, eager attention, so that its attention dropout is an
nn.Dropout over the (batch, heads, seq, seq) weights, the largest tensor dropped; dropout 0.1 on
the embeddings, the attention weights and both residual branches), built once and copied to both
variants. Blocks of steps alternate torch, sample, sample, torch, ... in the same process, so that
the machine's drift weighs on both alike; each block's median step time (forward, backward,
AdamW), and each block's peak resident set above the resident set before it (the kernel's
high-water mark, reset per block: monitoring/host_memory.py), the transient memory of the step.

    python bench/dropout.py            # 8 pairs of 20-step blocks, batch 16 x 128 tokens
    python bench/dropout.py --quick    # 3 pairs of 10 steps
    python bench/dropout.py --smoke    # 1 pair of 2 steps, a tiny model: that it runs (CI)

There is no goal set for the ratio: the figure says what a layout-independent mask costs on this
machine (on CPU; a GPU runs the same integer arithmetic as its own kernels, not measured here).
The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_of(layers: int, width: int, heads: int, seq: int, p: float):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=512, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads,
                     resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)
    return GPT2LMHeadModel(cfg, attn_implementation="eager") if _takes_attn(GPT2LMHeadModel) else \
        GPT2LMHeadModel(cfg)


def _takes_attn(cls) -> bool:
    import inspect

    return "attn_implementation" in inspect.signature(cls.__init__).parameters


def step_time(model, opt, x, step: int, sample: bool) -> float:
    from gearshift.strategies import rows as sample_rows

    started = time.perf_counter()
    with sample_rows.rows(0, step, sample_rows.places(0, len(x)) if sample else None):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def block(variant: dict, x, steps: int, first: int, peak) -> tuple[float, int]:
    """(median step time, peak resident bytes above the resident set at the block's start)."""
    from gearshift.monitoring.host_memory import _high_water

    peak.take("bench")
    before = _high_water()
    times = [step_time(variant["model"], variant["opt"], x, first + i, variant["sample"]) for i in range(steps)]
    return statistics.median(times), peak.take("bench") - before


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    import torch

    from gearshift.monitoring.host_memory import process_peak
    from gearshift.workers.step import sample_masks

    torch.set_num_threads(1)  # one core per worker, as a run's worker gets
    pairs, steps, (batch, seq, layers, width, heads) = (
        (1, 2, (4, 32, 1, 32, 2)) if args.smoke else (3, 10, (16, 128, 2, 128, 4)) if args.quick
        else (8, 20, (16, 128, 2, 128, 4)))
    torch.manual_seed(0)
    base = model_of(layers, width, heads, seq, 0.1).train()
    x = torch.randint(0, 512, (batch, seq))
    variants = {}
    for name in ("torch", "sample"):
        model = copy.deepcopy(base)
        swapped = sample_masks.per_sample(model) if name == "sample" else []
        variants[name] = {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-4),
                          "sample": name == "sample", "swapped": swapped}
    print(f"GPT-2 {layers} layers x {width} wide, {heads} heads, batch {batch} x {seq} tokens, dropout 0.1 "
          f"({len(variants['sample']['swapped'])} nn.Dropout swapped); {pairs} pairs of {steps}-step blocks")
    peak = process_peak()
    for v in variants.values():  # warm-up: the allocator's first steps, excluded
        block(v, x, 1, 0, peak)
    got: dict[str, list] = {"torch": [], "sample": []}
    step = 1
    for i in range(pairs):
        for name in (("torch", "sample") if i % 2 == 0 else ("sample", "torch")):
            t, mem = block(variants[name], x, steps, step, peak)
            step += steps
            got[name].append((t, mem))
            print(f"pair {i} {name:6s}  step {t * 1e3:7.1f} ms  transient peak {mem / 2**20:6.1f} MiB", flush=True)
    ratios = [s[0] / t[0] for s, t in zip(got["sample"], got["torch"])]
    med = statistics.median(ratios)
    mem = {n: statistics.median(m for _, m in got[n]) for n in got}
    print(f"sample/torch step time: {med:.3f} (spread {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} pairs)")
    print(f"transient peak of a step (median): torch {mem['torch'] / 2**20:.1f} MiB, sample "
          f"{mem['sample'] / 2**20:.1f} MiB")
    print(json.dumps({"ratio_step_time_sample_vs_torch": med, "spread": [min(ratios), max(ratios)],
                      "transient_peak_mib": {n: m / 2**20 for n, m in mem.items()},
                      "shape": {"batch": batch, "seq": seq, "layers": layers, "width": width, "heads": heads}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
