"""The benchmark's model registry: what each model is, how to build it, its data, its blocks.

Every model is wrapped so that ``forward(x, y)`` returns the training loss (cross-entropy), so the
loss is inside whatever a method compiles. Sizes come in two presets: ``"cpu"`` (what runs here
in the suite's time) and ``"gpu"`` (larger, for a GPU run). The vision models come from ``timm`` and
``torchvision`` when installed (random weights, never downloaded); without them from the small
built-in definitions in :mod:`bench.vision`, and :attr:`ModelSpec.source` says which.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from offload_compiler.demo import Batches, load_corpus
from offload_compiler.models import GPT, GPTConfig, Llama, LlamaConfig

from . import vision

__all__ = ["ModelSpec", "MODEL_NAMES", "get_model", "LMLoss", "ClassifierLoss"]

Batch = tuple[torch.Tensor, torch.Tensor]


class LMLoss(nn.Module):
    """``forward(idx [B, T], targets [B, T]) -> mean cross-entropy`` of a causal LM."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())


class ClassifierLoss(nn.Module):
    """``forward(images [B, C, H, W], labels [B]) -> mean cross-entropy`` of a classifier."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model.

    Attributes:
        name: registry key (``gpt``, ``llama``, ``vit``, ``resnet``).
        description: its shape, for the table.
        source: where the definition comes from (and, for a fallback, why).
        build: makes the loss-wrapped module (call under a fixed seed).
        make_batches: ``(count, seed) -> [(x, y), ...]`` on the CPU, the same for every method.
        block_containers: the ``ModuleList`` / ``Sequential`` modules whose children are the blocks
            that per-block checkpointing wraps.
    """

    name: str
    description: str
    source: str
    build: Callable[[], nn.Module]
    make_batches: Callable[[int, int], list[Batch]]
    block_containers: Callable[[nn.Module], list[nn.Module]]


def _lm_batches(batch: int, seq: int) -> Callable[[int, int], list[Batch]]:
    def make(count: int, seed: int) -> list[Batch]:
        batches = Batches(load_corpus(), batch, seq, seed=seed)
        return [batches.batch(i, torch.device("cpu")) for i in range(count)]

    return make


def _image_batches(batch: int, size: int, classes: int = 10) -> Callable[[int, int], list[Batch]]:
    """Synthetic, learnable images: a fixed random template per class plus noise."""

    def make(count: int, seed: int) -> list[Batch]:
        g = torch.Generator().manual_seed(seed)
        templates = torch.randn(classes, 3, size, size, generator=g)
        out = []
        for _ in range(count):
            y = torch.randint(0, classes, (batch,), generator=g)
            x = 0.5 * templates[y] + torch.randn(batch, 3, size, size, generator=g)
            out.append((x, y))
        return out

    return make


# Per preset: the shapes. "cpu" runs in the suite's time on 2 cores; "gpu" is for a GPU run;
# "tiny" keeps tests/test_bench.py fast.
SIZES: dict[str, dict[str, dict]] = {
    "tiny": {
        "gpt": dict(n_layer=2, n_head=2, n_embd=32, seq=32, batch=4),
        "llama": dict(n_layer=2, n_head=2, n_kv_head=1, n_embd=32, intermediate_size=64, seq=32, batch=4),
        "vit": dict(image=16, patch=4, width=32, depth=2, heads=2, batch=4),
        "resnet": dict(image=16, widths=(8, 16), blocks_per_stage=1, batch=4),
    },
    "cpu": {
        "gpt": dict(n_layer=4, n_head=4, n_embd=128, seq=128, batch=16),
        "llama": dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=352, seq=128, batch=16),
        "vit": dict(image=32, patch=4, width=128, depth=4, heads=4, batch=32),
        "resnet": dict(image=32, widths=(32, 64, 128), blocks_per_stage=2, batch=32),
    },
    "gpu": {
        "gpt": dict(n_layer=12, n_head=12, n_embd=768, seq=1024, batch=8),
        "llama": dict(n_layer=8, n_head=16, n_kv_head=4, n_embd=1024, intermediate_size=2816, seq=2048, batch=4),
        "vit": dict(image=224, patch=16, width=768, depth=12, heads=12, batch=64),
        "resnet": dict(image=224, widths=(64, 128, 256, 512), blocks_per_stage=2, batch=64),
    },
}

MODEL_NAMES = ("gpt", "llama", "vit", "resnet")


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def get_model(name: str, size: str = "cpu") -> ModelSpec:
    """The model ``name`` at preset ``size``.

    Raises:
        ValueError: for an unknown name or size.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size preset {size!r}; known: {sorted(SIZES)}")
    if name not in SIZES[size]:
        raise ValueError(f"unknown model {name!r}; known: {list(MODEL_NAMES)}")
    s = SIZES[size][name]
    if name == "gpt":
        cfg = GPTConfig(
            vocab_size=256, block_size=s["seq"], n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"]
        )
        return ModelSpec(
            name,
            f"GPT {s['n_layer']} layers, width {s['n_embd']}, seq {s['seq']}, batch {s['batch']}, byte vocab",
            "offload_compiler.models.GPT",
            lambda: LMLoss(GPT(cfg)),
            _lm_batches(s["batch"], s["seq"]),
            lambda m: [m.net.blocks],
        )
    if name == "llama":
        cfg = LlamaConfig(
            vocab_size=256,
            n_layer=s["n_layer"],
            n_head=s["n_head"],
            n_kv_head=s["n_kv_head"],
            n_embd=s["n_embd"],
            intermediate_size=s["intermediate_size"],
            max_seq_len=s["seq"],
        )
        return ModelSpec(
            name,
            f"Llama {s['n_layer']} layers, width {s['n_embd']}, {s['n_head']}/{s['n_kv_head']} heads (GQA), "
            f"SwiGLU {s['intermediate_size']}, seq {s['seq']}, batch {s['batch']}, byte vocab",
            "offload_compiler.models.Llama",
            lambda: LMLoss(Llama(cfg)),
            _lm_batches(s["batch"], s["seq"]),
            lambda m: [m.net.blocks],
        )
    if name == "vit":
        shape = (
            f"ViT {s['depth']} blocks, width {s['width']}, {s['heads']} heads, {s['image']}px images, "
            f"patch {s['patch']}, batch {s['batch']}, 10 classes"
        )
        if _have("timm"):
            from timm.models.vision_transformer import VisionTransformer

            def build() -> nn.Module:
                return ClassifierLoss(
                    VisionTransformer(
                        img_size=s["image"],
                        patch_size=s["patch"],
                        embed_dim=s["width"],
                        depth=s["depth"],
                        num_heads=s["heads"],
                        num_classes=10,
                    )
                )

            source = "timm VisionTransformer (random weights)"
        else:

            def build() -> nn.Module:
                return ClassifierLoss(
                    vision.ViT(s["image"], s["patch"], s["width"], s["depth"], s["heads"], num_classes=10)
                )

            source = "built-in bench/vision.py ViT (timm not installed)"
        return ModelSpec(name, shape, source, build, _image_batches(s["batch"], s["image"]), lambda m: [m.net.blocks])
    # resnet
    if _have("torchvision"):
        from torchvision.models.resnet import BasicBlock
        from torchvision.models.resnet import ResNet as TVResNet

        layers = [s["blocks_per_stage"]] * 4

        def build() -> nn.Module:
            return ClassifierLoss(TVResNet(BasicBlock, layers, num_classes=10))

        shape = f"torchvision ResNet, basic blocks {layers}, {s['image']}px images, batch {s['batch']}, 10 classes"
        source = "torchvision.models.resnet.ResNet (random weights)"

        def containers(m: nn.Module) -> list[nn.Module]:
            return [m.net.layer1, m.net.layer2, m.net.layer3, m.net.layer4]

    else:

        def build() -> nn.Module:
            return ClassifierLoss(vision.ResNet(s["widths"], s["blocks_per_stage"], num_classes=10))

        shape = (
            f"ResNet (CIFAR layout) widths {'/'.join(map(str, s['widths']))}, {s['blocks_per_stage']} basic blocks "
            f"per stage, {s['image']}px images, batch {s['batch']}, 10 classes"
        )
        source = "built-in bench/vision.py ResNet (torchvision not installed)"

        def containers(m: nn.Module) -> list[nn.Module]:
            return [m.net.blocks]

    return ModelSpec(name, shape, source, build, _image_batches(s["batch"], s["image"]), containers)
