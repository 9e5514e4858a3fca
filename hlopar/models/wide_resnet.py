"""Wide-ResNet (Zagoruyko & Komodakis, BMVC 2016) image classifier, in jax.numpy.

A ResNet-50/101-style network (He et al., CVPR 2016) of bottleneck blocks whose middle 3x3
convolution is `width_factor` times wider, as in the Wide-ResNet of Alpa's evaluation
(Zheng et al., OSDI'22, §8.1: "a variant of ResNet with larger channel sizes"):

  stem:  7x7/2 conv (base channels) -> batch norm -> ReLU -> 3x3/2 max pool
  stage i (i = 0..3, f = base * 2**i), blocks [3, 4, 6, 3] (50 layers) or [3, 4, 23, 3] (101):
         1x1 conv f -> BN -> ReLU -> 3x3 conv f*width (stride 2 in the first block of
         stages 1..3) -> BN -> ReLU -> 1x1 conv 4f -> BN, plus the shortcut (a strided 1x1
         conv + BN where the shape changes), then ReLU
  head:  global average pooling -> dense classifier -> softmax cross-entropy.

Convolutions are `lax.conv_general_dilated` in NHWC/HWIO without bias. Batch norm uses the
batch statistics (training mode) and learns a scale and an offset; running averages for
inference are not kept, since only the training step is modelled. The last BN of each block
starts at scale 0 (Goyal et al., 2017), so every block starts as the identity.

Configurations: Alpa, Appendix B, Table 8 (#layers, base channel, width factor), input image
(224, 224, 3) and 1024 classes (Appendix B), global batch size 1536 and FP32 (Table 4). The
parameter counts these give (`param_count`): 250M -> 0.254B, 1B -> 1.006B, 2B -> 1.965B,
4B -> 4.001B, 6.8B -> 6.728B, 13B -> 12.63B.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from hlopar.models import layers as L
from hlopar.models.adam import AdamConfig
from hlopar.models.common import TrainStep, dtype_of, keys, resolve_config, train_step_for

STAGE_SIZES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}
_DIMS = ("NHWC", "HWIO", "NHWC")


@dataclass(frozen=True)
class WideResNetConfig:
    stage_sizes: tuple[int, ...]
    base_channels: int
    width_factor: int
    image_size: int = 224
    in_channels: int = 3
    num_classes: int = 1024
    batch_size: int = 1536
    dtype: str = "float32"

    @property
    def num_layers(self) -> int:
        """Depth in the ResNet convention: 3 convs per bottleneck block, the stem and the head."""
        return 3 * sum(self.stage_sizes) + 2


WIDE_RESNET_CONFIGS: dict[str, WideResNetConfig] = {
    "tiny": WideResNetConfig(
        stage_sizes=(1, 1), base_channels=8, width_factor=2, image_size=32, num_classes=10, batch_size=4
    ),
    # Alpa, Table 8: #params, #layers, base channel, width factor.
    "250M": WideResNetConfig(STAGE_SIZES[50], base_channels=160, width_factor=2),
    "1B": WideResNetConfig(STAGE_SIZES[50], base_channels=320, width_factor=2),
    "2B": WideResNetConfig(STAGE_SIZES[50], base_channels=448, width_factor=2),
    "4B": WideResNetConfig(STAGE_SIZES[50], base_channels=640, width_factor=2),
    "6.8B": WideResNetConfig(STAGE_SIZES[50], base_channels=320, width_factor=16),
    "13B": WideResNetConfig(STAGE_SIZES[101], base_channels=320, width_factor=16),
}


def init_conv(kh: int, kw: int, c_in: int, c_out: int, dtype: str):
    """He-normal initialization (He et al., ICCV 2015), fan-in mode."""
    std = (2.0 / (kh * kw * c_in)) ** 0.5
    return L.normal((kh, kw, c_in, c_out), dtype, std)


def conv(kernel, x, stride: int = 1):
    kh, kw = kernel.shape[:2]
    padding = ((kh // 2, (kh - 1) // 2), (kw // 2, (kw - 1) // 2))
    return lax.conv_general_dilated(
        x, kernel, window_strides=(stride, stride), padding=padding, dimension_numbers=_DIMS
    )


def init_batch_norm(c: int, dtype: str, scale: float = 1.0):
    return {"scale": L.constant((c,), dtype, scale), "bias": L.constant((c,), dtype)}


def batch_norm(params, x, eps: float = 1e-5):
    """Batch normalization (Ioffe & Szegedy, 2015) with the statistics of this batch."""
    x32 = L.at_least_f32(x)
    mean = jnp.mean(x32, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(x32 - mean), axis=(0, 1, 2))
    y = ((x32 - mean) * lax.rsqrt(var + eps)).astype(x.dtype)
    return y * params["scale"] + params["bias"]


def max_pool(x, window: int = 3, stride: int = 2):
    pad = ((0, 0), (window // 2, window // 2), (window // 2, window // 2), (0, 0))
    # A Python scalar init makes jax pick its differentiable max-pool primitive.
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, window, window, 1), (1, stride, stride, 1), pad)


def init_block(c_in: int, filters: int, width: int, dtype: str):
    mid = filters * width
    params = {
        "conv1": init_conv(1, 1, c_in, filters, dtype),
        "bn1": init_batch_norm(filters, dtype),
        "conv2": init_conv(3, 3, filters, mid, dtype),
        "bn2": init_batch_norm(mid, dtype),
        "conv3": init_conv(1, 1, mid, 4 * filters, dtype),
        "bn3": init_batch_norm(4 * filters, dtype, scale=0.0),
    }
    if c_in != 4 * filters:
        params["proj_conv"] = init_conv(1, 1, c_in, 4 * filters, dtype)
        params["proj_bn"] = init_batch_norm(4 * filters, dtype)
    return params


def block(params, x, stride: int):
    y = jax.nn.relu(batch_norm(params["bn1"], conv(params["conv1"], x)))
    y = jax.nn.relu(batch_norm(params["bn2"], conv(params["conv2"], y, stride)))
    y = batch_norm(params["bn3"], conv(params["conv3"], y))
    shortcut = x
    if "proj_conv" in params:
        shortcut = batch_norm(params["proj_bn"], conv(params["proj_conv"], x, stride))
    elif stride != 1:
        raise ValueError("a strided block needs a projection shortcut")
    return jax.nn.relu(shortcut + y)


def _block_plan(config: WideResNetConfig):
    """``(stage, filters, stride)`` of each block, in order."""
    plan = []
    for i, n in enumerate(config.stage_sizes):
        for j in range(n):
            plan.append((i, config.base_channels * 2**i, 2 if i > 0 and j == 0 else 1))
    return plan


def param_specs(config: WideResNetConfig):
    """The parameters as a tree of `ParamSpec`."""
    dtype, base = config.dtype, config.base_channels
    blocks, c_in = [], base
    for _, filters, _ in _block_plan(config):
        blocks.append(init_block(c_in, filters, config.width_factor, dtype))
        c_in = 4 * filters
    return {
        "stem": {
            "conv": init_conv(7, 7, config.in_channels, base, dtype),
            "bn": init_batch_norm(base, dtype),
        },
        "blocks": blocks,
        "head": L.init_dense(c_in, config.num_classes, dtype),
    }


def forward(config: WideResNetConfig, params, images: jax.Array) -> jax.Array:
    """Logits ``[batch, classes]`` for ``images: [batch, H, W, C]``."""
    with jax.named_scope("stem"):
        x = conv(params["stem"]["conv"], images.astype(dtype_of(config.dtype)), stride=2)
        x = max_pool(jax.nn.relu(batch_norm(params["stem"]["bn"], x)))
    for i, ((_, _, stride), p) in enumerate(zip(_block_plan(config), params["blocks"])):
        with jax.named_scope(f"layer_{i}"):
            x = block(p, x, stride)
    with jax.named_scope("head"):
        x = jnp.mean(x, axis=(1, 2))
        return L.dense(params["head"], x)


def loss_fn(config: WideResNetConfig, params, batch) -> jax.Array:
    """Softmax cross-entropy, mean over the batch."""
    logits = forward(config, params, batch["images"])
    with jax.named_scope("loss"):
        return L.softmax_cross_entropy(logits, batch["labels"])


def make_batch(config: WideResNetConfig, rng: jax.Array):
    k_img, k_lbl = keys(rng, 2)
    shape = (config.batch_size, config.image_size, config.image_size, config.in_channels)
    return {
        "images": jax.random.normal(k_img, shape, dtype_of(config.dtype)),
        "labels": jax.random.randint(k_lbl, (config.batch_size,), 0, config.num_classes, jnp.int32),
    }


def train_step(config: str | WideResNetConfig = "tiny", optimizer: AdamConfig | None = None) -> TrainStep:
    """The Wide-ResNet training step of a named configuration (see `WIDE_RESNET_CONFIGS`)."""
    cfg = resolve_config("wide_resnet", WIDE_RESNET_CONFIGS, WideResNetConfig, config)
    return train_step_for(
        "wide_resnet",
        WIDE_RESNET_CONFIGS,
        cfg,
        param_specs=param_specs,
        loss_fn=loss_fn,
        make_batch=make_batch,
        optimizer=optimizer,
    )
