"""Built-in models: an MLP for MNIST-shaped inputs and a small decoder-only transformer.

Both are written so that tensor parallelism can shard them later without a rewrite: every
projection is its own nn.Linear (q, k, v separately), and attention infers its local number
of heads from the projection's output width instead of storing it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gearshift.strategies.rows import checkpoint_contexts


class MLP(nn.Module):
    def __init__(self, in_features: int = 784, hidden: int = 512, out_features: int = 10, layers: int = 1,
                 activation_checkpointing: bool = False):
        super().__init__()
        dims = [in_features] + [hidden] * layers
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.out = nn.Linear(dims[-1], out_features)
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.hidden:
            if self.activation_checkpointing and self.training:
                x = checkpoint(lambda h, layer=layer: F.relu(layer(h)), x, use_reentrant=False)
            else:
                x = F.relu(layer(x))
        return self.out(x)

    def tp_plan(self, tp: int) -> dict[str, str]:
        """Hidden layers alternate column- and row-parallel (a Megatron pair per two layers); the
        output layer closes the last pair when one is open, else it stays replicated."""
        plan = {f"hidden.{i}": ("colwise" if i % 2 == 0 else "rowwise") for i in range(len(self.hidden))}
        if len(self.hidden) % 2:
            plan["out"] = "rowwise"
        return plan


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool):
        super().__init__()
        self.head_dim = n_embd // n_head
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        # No key bias: q.(k + b) shifts every score of a query by the same q.b, which softmax
        # ignores, so its true gradient is zero and Adam would only amplify rounding noise.
        self.k = nn.Linear(n_embd, n_embd, bias=False)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y):  # (b, t, h*d) -> (b, h, t, d); h is whatever this rank holds
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, n_embd: int, ffn_mult: int, bias: bool):
        super().__init__()
        self.fc = nn.Linear(n_embd, ffn_mult * n_embd, bias=bias)
        self.proj = nn.Linear(ffn_mult * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, ffn_mult: int, bias: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = Attention(n_embd, n_head, bias)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = FeedForward(n_embd, ffn_mult, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer over token ids; returns logits of shape (batch, seq, vocab)."""

    def __init__(self, vocab_size: int = 128, block_size: int = 64, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 128, ffn_mult: int = 4, bias: bool = True, dropout: float = 0.0,
                 activation_checkpointing: bool = False):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.block_size = block_size
        self.n_head = n_head
        self.activation_checkpointing = activation_checkpointing
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, ffn_mult, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def tp_plan(self, tp: int) -> dict[str, str]:
        """Megatron: q, k, v and the first MLP layer column-parallel (heads and ffn width split),
        the projections after them row-parallel; embeddings, norms and the head replicated."""
        n_head = self.n_head
        if n_head % tp:
            raise ValueError(f"n_head({n_head}) % tp({tp}) = {n_head % tp}: attention splits by whole heads")
        return {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
                "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False, context_fn=checkpoint_contexts)  # strategies/rows.py
            else:
                x = block(x)
        return self.head(self.ln_f(x))


def mlp(in_features: int = 784, hidden: int = 512, out_features: int = 10, layers: int = 1,
        activation_checkpointing: bool = False) -> MLP:
    return MLP(in_features, hidden, out_features, layers, activation_checkpointing)


def gpt(vocab_size: int = 128, block_size: int = 64, n_layer: int = 2, n_head: int = 4, n_embd: int = 128,
        ffn_mult: int = 4, bias: bool = True, dropout: float = 0.0, activation_checkpointing: bool = False) -> GPT:
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, ffn_mult, bias, dropout, activation_checkpointing)
