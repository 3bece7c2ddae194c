"""The cost model's view of a job: the shape of the job's model (built once, on the meta device
where it can be) and what `costmodel.memory` needs from the job besides (micro-batch, optimizer
state, compute dtype), and the memory check the policy and the controller ask of a layout.

Apart from costmodel.py, which is pure Python over shapes: this part builds the job's model (torch,
the job's own code) to count what it holds.
"""

from __future__ import annotations

from dataclasses import replace

from gearshift.orchestrator.policy.costmodel import (OPTIMIZER_STATES, Activations, MemoryOverhead, ModelShape,
                                                     fits, memory)


def compute_bytes_of(job) -> float:
    """Bytes an element of the job's activations and weight casts takes: 2 under bf16 or fp16
    autocast (given alone or as phases), else 4."""
    p = job.train.precision
    return 2.0 if (p.get("dtype") if isinstance(p, dict) else p) in ("bf16", "fp16") else 4.0


def memory_settings(job) -> dict:
    """What `memory` needs from a job besides the model and layout: its micro-batch, the fp32
    tensors its optimizer keeps per parameter (Adam two, SGD one with momentum, none without) and
    its compute dtype's bytes."""
    opt = job.optimizer
    states = OPTIMIZER_STATES[opt.name] + (1 if opt.name == "sgd" and opt.momentum > 0 else 0)
    return {"micro_batch": job.train.micro_batch_size, "optimizer_states": states,
            "compute_bytes": compute_bytes_of(job)}


def memory_check(job, device_memory_bytes: float, overhead: MemoryOverhead = MemoryOverhead(),
                 model: ModelShape | None = None):
    """A `fits(layout) -> (bool, evidence)` for the adaptive policy: `memory` of the job's model
    (its shape, micro-batch, optimizer and precision) under the layout (anything with dp, tp and
    shard) against devices of `device_memory_bytes`. The evidence holds the predicted and available
    bytes, why it does not fit, and the breakdown."""
    model = model if model is not None else shape_of_job(job)
    settings = memory_settings(job)

    def check(layout) -> tuple[bool, dict]:
        from gearshift.orchestrator.policy.pipeline_cost import memory_of  # noqa: PLC0415

        mem = memory_of(model, layout, global_batch=job.train.global_batch_size, overhead=overhead, **settings)
        ok, said = fits(mem, device_memory_bytes)
        return ok, {**said, "breakdown": mem}

    return check


def shape_of_job(job) -> ModelShape:
    """The cost model's view of a job's model. The built-in GPT by its shape (its parameters
    counted exactly, on the meta device; its FLOPs by Megatron-LM's count; its activations per
    `transformer_activations`); any other model by its parameter count (built once, on the meta
    device where it can be) at 6 FLOPs per parameter per sample, with no tensor-parallel
    activations modelled, and its activations (the built-in MLP's only) as every Linear's input
    (the ReLU's output before it) and the logits. The share of parameters tensor parallelism
    splits is what the model's plan shards."""
    import torch  # noqa: PLC0415

    from gearshift.workers.build import components  # noqa: PLC0415

    spec = job.to_dict()["model"]
    grad_bytes = 4.0  # parameters and their gradients stay fp32 under autocast
    act = compute_bytes_of(job)
    recompute = bool(job.train.activation_checkpointing or (spec.get("kwargs") or {}).get("activation_checkpointing"))
    model, returned = components.model_for_checks(spec, [job.base_dir])
    params = sum(p.numel() for p in model.parameters())
    try:
        plan = components.tp_plan(model, job.parallel.tp_plan, returned, 1)
    except components.ComponentError:  # a plan that cannot shard: tensor layouts are refused elsewhere
        plan = None
    split = _tp_split_params(model, plan)
    if spec.get("name") == "gpt":
        k = model
        blocks = len(k.blocks)
        n_embd, vocab = k.tok_emb.embedding_dim, k.tok_emb.num_embeddings
        ffn_mult = k.blocks[0].mlp.fc.out_features // n_embd if blocks else 4
        # the built-in GPT's q, k and v are separate column-parallel layers, its head is replicated
        # (workers/build/models.py)
        shape = ModelShape.transformer(blocks, n_embd, k.block_size, vocab, act_bytes=act, grad_bytes=grad_bytes,
                                       recompute=recompute, tp_allreduces_per_layer=6, head_parallel=False,
                                       ffn_mult=ffn_mult, heads=k.n_head, params=params, name="gpt")
        block = sum(p.numel() for p in k.blocks[0].parameters()) if blocks else 0
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        from gearshift.strategies.fsdp import find_units

        found, _ = find_units(model, job.parallel.fsdp_units, outside=True)
        outside = sum(1 for n, _ in found if not n.startswith("blocks.")) if not job.parallel.fsdp_units else 0
        return replace(shape, tp_param_share=split / params if params else 1.0, block_params=block,
                       cast_share=linear / params if params else 1.0, outside_units=outside)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    acts, cast = None, 1.0
    if spec.get("name") == "mlp" and linears:
        # the first layer's input is the data, which needs no gradient: its weight's copy is not kept
        cast = sum(m.weight.numel() for m in linears[1:]) / params
        # a vector a sample: each Linear keeps its input, which is the ReLU's output before it (one
        # tensor, kept once); outside: the logits and the loss's copy of them
        n = len(linears)
        per_layer = sum(m.in_features for m in linears) * act / n
        acts = Activations(layers=n, per_layer=per_layer, per_layer_split=0.0, layer_input=per_layer,
                           outside=linears[-1].out_features * (act + 4), recompute=recompute)
    return ModelShape(params=params, flops_per_sample=6.0 * params, grad_bytes_per_param=grad_bytes,
                      name=spec.get("name") or spec.get("entrypoint") or "model",
                      tp_param_share=split / params if params and split else 1.0, activations=acts,
                      cast_share=cast)


def _tp_split_params(model, plan: dict | None) -> float:
    """Parameters the plan splits over tp ranks: a sharded Linear's weight, and its bias when
    column-parallel (a row-parallel layer's bias is added whole on every rank)."""
    if not plan:
        return 0.0
    from gearshift.strategies.tp_plan import PlanError, resolve  # noqa: PLC0415

    try:
        styles = resolve(model, plan, 1)
    except PlanError:
        return 0.0
    modules = dict(model.named_modules())
    return float(sum(modules[n].weight.numel() + (modules[n].bias.numel() if style == "colwise" and
                                                  modules[n].bias is not None else 0)
                     for n, style in styles.items()))

