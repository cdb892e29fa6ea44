"""The gradients of torchvision's ResNet-50 and ViT-B/16 as data: (name,
shape) in the order backward produces them (the reverse of the parameters'
registration order, which is how their post-accumulate hooks fire, give or
take the two gradients of one node). Written from the architectures'
definitions (torchvision is not installed here): ResNet-50 has 161 gradient
tensors, 25,557,032 parameters (102.2 MB in float32); ViT-B/16 has 152 and
86,567,656 (346.3 MB). Used by tests/gpu/bucket_worker.py.
"""

from __future__ import annotations

import math


def resnet50() -> list[tuple[str, tuple[int, ...]]]:
    """torchvision.models.resnet50: Bottleneck blocks [3, 4, 6, 3], expansion 4."""
    params: list[tuple[str, tuple[int, ...]]] = []

    def conv_bn(prefix: str, conv: str, bn: str, out_c: int, in_c: int, k: int) -> None:
        params.append((f"{prefix}{conv}.weight", (out_c, in_c, k, k)))
        params.append((f"{prefix}{bn}.weight", (out_c,)))
        params.append((f"{prefix}{bn}.bias", (out_c,)))

    conv_bn("", "conv1", "bn1", 64, 3, 7)
    inplanes = 64
    for layer, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for b in range(blocks):
            p = f"layer{layer}.{b}."
            conv_bn(p, "conv1", "bn1", planes, inplanes, 1)
            conv_bn(p, "conv2", "bn2", planes, planes, 3)
            conv_bn(p, "conv3", "bn3", planes * 4, planes, 1)
            if b == 0:  # stride or width changes: a projection shortcut
                conv_bn(p, "downsample.0", "downsample.1", planes * 4, inplanes, 1)
            inplanes = planes * 4
    params.append(("fc.weight", (1000, 2048)))
    params.append(("fc.bias", (1000,)))
    return params[::-1]


def vit_b_16() -> list[tuple[str, tuple[int, ...]]]:
    """torchvision.models.vit_b_16: patch 16, 12 layers, hidden 768, MLP 3072,
    224x224 images (196 patches + the class token)."""
    d, mlp = 768, 3072
    params: list[tuple[str, tuple[int, ...]]] = [
        ("class_token", (1, 1, d)),
        ("conv_proj.weight", (d, 3, 16, 16)),
        ("conv_proj.bias", (d,)),
        ("encoder.pos_embedding", (1, 197, d)),
    ]
    for i in range(12):
        p = f"encoder.layers.encoder_layer_{i}."
        params += [
            (p + "ln_1.weight", (d,)),
            (p + "ln_1.bias", (d,)),
            (p + "self_attention.in_proj_weight", (3 * d, d)),
            (p + "self_attention.in_proj_bias", (3 * d,)),
            (p + "self_attention.out_proj.weight", (d, d)),
            (p + "self_attention.out_proj.bias", (d,)),
            (p + "ln_2.weight", (d,)),
            (p + "ln_2.bias", (d,)),
            (p + "mlp.0.weight", (mlp, d)),
            (p + "mlp.0.bias", (mlp,)),
            (p + "mlp.3.weight", (d, mlp)),
            (p + "mlp.3.bias", (d,)),
        ]
    params += [
        ("encoder.ln.weight", (d,)),
        ("encoder.ln.bias", (d,)),
        ("heads.head.weight", (1000, d)),
        ("heads.head.bias", (1000,)),
    ]
    return params[::-1]


MODELS = {"resnet50": resnet50, "vit_b_16": vit_b_16}


def elements(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(s) for _, s in shapes)
