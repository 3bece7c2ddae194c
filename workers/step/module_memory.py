"""The memory of a live run by module, measured on rank 0's first update (`gearshift watch` shows
the top three; `gearshift inspect memory` draws the whole tree before a run).

During the first update's forward, each tensor autograd keeps for backward is counted once, for
the innermost module running when it was saved (torch.autograd.graph.saved_tensors_hooks), less
the parameters themselves (a Linear keeps its weight: those bytes are the parameter's);
after the update, each module's own parameters, their gradients and the optimizer's state for
them are added (this rank's pieces of a sharded parameter). Not taken under train.compile (hooks
on the modules would change what is compiled).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class ModuleMemory:
    def __init__(self):
        self.saved: dict[str, int] | None = None  # module -> bytes kept for backward, once measured
        self.sent = False

    @property
    def ready(self) -> bool:
        return self.saved is not None and not self.sent

    @contextlib.contextmanager
    def watching(self, model: nn.Module):
        if self.saved is not None:  # measured already: nothing on later steps
            yield
            return
        from torch.autograd.graph import saved_tensors_hooks

        names = {id(m): n for n, m in model.named_modules()}
        stack, seen, saved = [""], set(), dict.fromkeys(names.values(), 0)

        seen.update(k for k in map(storage_key, model.parameters()) if k)  # a weight kept is a parameter's bytes

        def pack(t):
            key = storage_key(t)
            if key and key not in seen:
                seen.add(key)
                saved[stack[-1]] += key[1]
            return t

        def enter(mod, args):
            stack.append(names.get(id(mod), stack[-1]))

        def leave(mod, args, out):  # returns None: a forward hook's return value would replace the output
            stack.pop()

        hooks = [m.register_forward_pre_hook(enter) for m in model.modules()]
        hooks += [m.register_forward_hook(leave) for m in model.modules()]
        try:
            with saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            for h in hooks:
                h.remove()
        self.saved = saved

    def take(self, model: nn.Module, optimizer, top: int = 3) -> list[dict]:
        """The `top` modules by their own bytes (parameters, gradients, optimizer state, kept
        activations), largest first."""
        self.sent = True
        rows = []
        for name, module in model.named_modules():
            own = {"parameters": 0, "gradients": 0, "optimizer": 0, "activations": self.saved.get(name, 0)}
            for p in module.parameters(recurse=False):
                own["parameters"] += _bytes(p)
                own["gradients"] += _bytes(p.grad) if p.grad is not None else 0
                own["optimizer"] += sum(_bytes(v) for v in (optimizer.state.get(p) or {}).values()
                                        if isinstance(v, torch.Tensor) and v.dim() > 0)
            total = sum(own.values())
            if total:
                rows.append({"module": name or "(model)", "type": type(module).__name__, "bytes": total, **own})
        return sorted(rows, key=lambda r: -r["bytes"])[:top]


def storage_key(t) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage (a DTensor's local one); None where it has none."""
    try:
        storage = getattr(t, "_local_tensor", t).untyped_storage()
        return (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else None
    except (RuntimeError, NotImplementedError):
        return None


def _bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()
