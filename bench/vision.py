"""Small built-in vision models, used by the benchmarks when ``timm`` / ``torchvision`` are absent.

Both are written from the published architectures, sized for a 2-core CPU:

- :class:`ViT`: Dosovitskiy et al., "An Image is Worth 16x16 Words" (2021): non-overlapping patches
  embedded by a strided convolution, a class token, learned position embeddings, pre-LayerNorm
  encoder blocks (multi-head self-attention, GELU MLP), the class token's final state classified.
- :class:`ResNet`: He et al., "Deep Residual Learning for Image Recognition" (2016): basic blocks
  (two 3x3 convolutions with batch norm, identity or 1x1-projection shortcut), the CIFAR layout of
  section 4.2 (a 3x3 stem, three stages, global average pooling, one linear layer).

Shapes: ``forward(images [batch, 3, H, W] float) -> logits [batch, num_classes]``. The blocks a
per-block checkpointing wrapper should wrap are in each model's ``blocks`` (an ``nn.ModuleList``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ViT", "ResNet"]


class _ViTBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, mlp_ratio * width)
        self.fc2 = nn.Linear(mlp_ratio * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(B, N, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    """Vision Transformer. ``forward(images [B, channels, size, size]) -> logits [B, num_classes]``."""

    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 4,
        width: int = 128,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: int = 4,
        num_classes: int = 10,
        channels: int = 3,
    ):
        super().__init__()
        if image_size % patch_size or width % heads:
            raise ValueError(f"ViT: image_size {image_size} % patch_size {patch_size} and width % heads must be 0")
        num_patches = (image_size // patch_size) ** 2
        self.patch = nn.Conv2d(channels, width, patch_size, stride=patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.randn(1, num_patches + 1, width) * 0.02)
        self.blocks = nn.ModuleList(_ViTBlock(width, heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet of basic blocks. ``forward(images [B, 3, H, W]) -> logits [B, num_classes]``."""

    def __init__(self, widths=(32, 64, 128), blocks_per_stage: int = 2, num_classes: int = 10, channels: int = 3):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(channels, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks_per_stage):
                blocks.append(_BasicBlock(cin, w, 2 if (i > 0 and j == 0) else 1))
                cin = w
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))
