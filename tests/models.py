"""Small models for the end-to-end tests. Sizes are chosen so that saved activations, not
parameters, dominate the peak (so a 50% budget is reachable)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from offload_compiler.models import GPT, GPTConfig


class MLP(nn.Module):
    def __init__(self, d_in=64, d_hidden=128, d_out=16, depth=8):
        super().__init__()
        dims = [d_in] + [d_hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.cross_entropy(self.head(x), y)


class CNN(nn.Module):
    def __init__(self, channels=16, classes=10, depth=6):
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv2d(3 if i == 0 else channels, channels, 3, padding=1, bias=False) for i in range(depth)
        )
        self.bns = nn.ModuleList(nn.BatchNorm2d(channels) for _ in range(depth))
        self.fc = nn.Linear(channels * 8 * 8, classes)

    def forward(self, x, y):
        for conv, bn in zip(self.convs, self.bns):
            x = F.relu(bn(conv(x)))
        x = F.max_pool2d(x, 2)
        return F.cross_entropy(self.fc(x.flatten(1)), y)


class GPTLoss(nn.Module):
    """GPT with the loss inside; ``shifted`` uses next-token targets on ``logits[:, :-1]`` (a
    non-contiguous saved view)."""

    def __init__(self, cfg=None, shifted=False):
        super().__init__()
        self.gpt = GPT(cfg or GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32))
        self.shifted = shifted

    def forward(self, idx, targets):
        logits = self.gpt(idx)
        if self.shifted:
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class TransposeSaved(nn.Module):
    """Saves a tensor and its transpose: ``h @ h.t()`` keeps both views of one storage."""

    def __init__(self, d=128, depth=8):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x, scale):
        total = x.new_zeros(())
        h = x
        for lin in self.lins:
            h = torch.tanh(lin(h))
            total = total + (h @ h.t()).pow(2).mean() * scale
        return total


class InPlace(nn.Module):
    """In-place ops in the forward (functionalized by AOTAutograd), valid in eager too."""

    def __init__(self, d=128, depth=8):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x, y):
        h = x
        for lin in self.lins:
            h = lin(h)
            h.relu_()
            h = h * 1.5
            h.add_(0.25)
        h.sigmoid_()
        return ((h - y) ** 2).mean()


def mlp_batch(n=4096):
    return torch.randn(n, 64), torch.randint(0, 16, (n,))


def cnn_batch(n=32):
    return torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,))


def gpt_batch(n=32, t=32, vocab=64):
    return torch.randint(0, vocab, (n, t)), torch.randint(0, vocab, (n, t))


def square_batch(n=512, d=128):
    return torch.randn(n, d), torch.tensor(0.5)


def inplace_batch(n=1024, d=128):
    return torch.randn(n, d), torch.rand(n, d)


def attention_blocks(d: int, n: int = 2) -> nn.ModuleList:
    """``n`` pre-norm attention blocks as module dicts (``ln1``, ``qkv``, ``proj``, ``ln2``,
    ``fc``, ``fc2``) for the fresh-user trials' models (each runs them its own way)."""
    return nn.ModuleList(
        nn.ModuleDict(
            {
                "ln1": nn.LayerNorm(d),
                "qkv": nn.Linear(d, 3 * d),
                "proj": nn.Linear(d, d),
                "ln2": nn.LayerNorm(d),
                "fc": nn.Linear(d, 4 * d),
                "fc2": nn.Linear(4 * d, d),
            }
        )
        for _ in range(n)
    )
