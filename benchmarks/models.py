"""Models and synthetic data of the scale benchmark (``benchmarks/scale.py``).

* ResNet-20 (He, Zhang, Ren & Sun 2016, the CIFAR variant): a 3x3x16 stem, 3 stages of 3
  basic blocks (16, 32, 64 channels; the first block of stages 2 and 3 strides by 2 and
  projects its shortcut with a 1x1 convolution + BatchNorm), global average pooling,
  dense 10: 272,474 trainable parameters. Convolutions have no bias (BatchNorm follows).
* ResNet-18 (ImageNet-style: 4 stages of 2 basic blocks, 64-512 channels) on 32x32
  inputs as CIFAR papers run it: 3x3 stem with stride 1, no max pooling; 11.2M parameters.
* A small GPT: token + position embeddings, 2 pre-LayerNorm blocks (causal multi-head
  attention, 4 heads of 32, and a 4x GELU MLP), a final LayerNorm and an untied head to
  the vocabulary (256); d = 128, sequences of 64 tokens.

BatchNorm runs in inference mode (moving statistics), as spectra's operators do by
default. With freshly initialised moving statistics (mean 0, variance 1) a 20-layer
residual net's activations grow by orders of magnitude, so :func:`calibrate_batchnorm`
sets every moving statistic to the statistics of one batch (one training-mode call with
momentum 0), which is what a trained network's statistics are close to.

:func:`torch_resnet20` builds the PyTorch twin of a Keras ResNet-20 with its weights
(NHWC kernels ``(h, w, in, out)`` to NCHW ``(out, in, h, w)``); the twin takes the same
NHWC images and permutes them itself.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np


# -- data ----------------------------------------------------------------------------------
def cifar_like(examples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Seeded synthetic CIFAR-shaped data: images uniform in [0, 1) of shape (32, 32, 3)
    standardised per channel, and uniformly random labels in 0..9 (no structure to learn)."""
    rng = np.random.default_rng(seed)
    images = rng.uniform(0.0, 1.0, (examples, 32, 32, 3)).astype(np.float32)
    images = (images - 0.5) / np.float32(np.sqrt(1.0 / 12.0))
    return images, rng.integers(0, 10, examples).astype(np.int32)


def token_sequences(
    sequences: int, length: int = 64, vocab: int = 256, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random token sequences and their next-token targets (the sequence shifted
    by one, a random last token), both ``int32`` of shape (sequences, length)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (sequences, length + 1)).astype(np.int32)
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


# -- ResNets (Keras) ------------------------------------------------------------------------
def _conv(filters: int, size: int, stride: int, name: str) -> keras.layers.Layer:
    return keras.layers.Conv2D(
        filters,
        size,
        strides=stride,
        padding="same",
        use_bias=False,
        kernel_initializer="he_normal",
        name=name,
    )


def _bn(name: str) -> keras.layers.Layer:
    return keras.layers.BatchNormalization(momentum=0.0, epsilon=1e-5, name=name)


def _basic_block(x: Any, filters: int, stride: int, name: str) -> Any:
    y = _conv(filters, 3, stride, f"{name}_conv1")(x)
    y = keras.layers.ReLU()(_bn(f"{name}_bn1")(y))
    y = _bn(f"{name}_bn2")(_conv(filters, 3, 1, f"{name}_conv2")(y))
    if stride != 1 or x.shape[-1] != filters:
        x = _bn(f"{name}_proj_bn")(_conv(filters, 1, stride, f"{name}_proj")(x))
    return keras.layers.ReLU()(keras.layers.Add()([x, y]))


def _resnet(stages: list[tuple[int, int]], stem: int, name: str) -> keras.Model:
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.ReLU()(_bn("stem_bn")(_conv(stem, 3, 1, "stem")(inputs)))
    for s, (filters, blocks) in enumerate(stages):
        for b in range(blocks):
            stride = 2 if s > 0 and b == 0 else 1
            x = _basic_block(x, filters, stride, f"s{s + 1}b{b + 1}")
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(x), name=name)


def resnet20() -> keras.Model:
    """ResNet-20 for CIFAR-10 (272,474 trainable parameters), logits out."""
    return _resnet([(16, 3), (32, 3), (64, 3)], 16, "resnet20")


def resnet18() -> keras.Model:
    """ResNet-18 (ImageNet widths, CIFAR stem: 11.2M trainable parameters), logits out."""
    return _resnet([(64, 2), (128, 2), (256, 2), (512, 2)], 64, "resnet18")


def calibrate_batchnorm(model: keras.Model, images: np.ndarray) -> None:
    """Set every BatchNorm layer's moving statistics to those of ``images`` (one
    training-mode call; the layers are built with momentum 0)."""
    model(images, training=True)


# -- a small GPT (Keras) ----------------------------------------------------------------------
def gpt(vocab: int = 256, length: int = 64, width: int = 128, heads: int = 4, layers: int = 2):
    """A 2-layer GPT with causal attention, logits of shape (batch, length, vocab)."""
    tokens = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocab, width, name="token_embedding")(tokens)
    positions = keras.layers.Embedding(length, width, name="position_embedding")
    x = x + positions(keras.ops.arange(length))[None]
    for i in range(layers):
        y = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln1")(x)
        y = keras.layers.MultiHeadAttention(heads, width // heads, name=f"block{i}_attention")(
            y, y, use_causal_mask=True
        )
        x = x + y
        y = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln2")(x)
        y = keras.layers.Dense(4 * width, activation="gelu", name=f"block{i}_mlp_in")(y)
        x = x + keras.layers.Dense(width, name=f"block{i}_mlp_out")(y)
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    return keras.Model(tokens, keras.layers.Dense(vocab, name="head")(x), name="gpt_2x128")


# -- the PyTorch twin of ResNet-20 ------------------------------------------------------------
def torch_resnet20(torch: Any, model: keras.Model) -> Any:
    """A PyTorch ResNet-20 holding the Keras model's weights and BatchNorm statistics, in
    eval mode; it takes NHWC images (as the Keras model) and returns logits."""
    nn = torch.nn
    layers = {layer.name: layer for layer in model.layers}

    def conv(name: str) -> Any:
        (kernel,) = (np.asarray(w) for w in layers[name].get_weights())
        h, _, cin, cout = kernel.shape
        stride = layers[name].strides[0]
        # Keras' "same" padding of an even input by a strided 3x3 kernel pads only the
        # bottom and right (by 1); PyTorch's padding=1 would pad all sides.
        asymmetric = stride == 2 and h == 3
        padding = 0 if asymmetric else h // 2
        module = nn.Conv2d(cin, cout, h, stride=stride, padding=padding, bias=False)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(kernel.transpose(3, 2, 0, 1).copy()))
        return nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), module) if asymmetric else module

    def bn(name: str) -> Any:
        gamma, beta, mean, var = (np.asarray(w) for w in layers[name].get_weights())
        module = nn.BatchNorm2d(gamma.shape[0], eps=layers[name].epsilon)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(gamma))
            module.bias.copy_(torch.from_numpy(beta))
            module.running_mean.copy_(torch.from_numpy(mean))
            module.running_var.copy_(torch.from_numpy(var))
        return module

    class Block(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.conv1, self.bn1 = conv(f"{name}_conv1"), bn(f"{name}_bn1")
            self.conv2, self.bn2 = conv(f"{name}_conv2"), bn(f"{name}_bn2")
            self.proj = None
            if f"{name}_proj" in layers:
                self.proj = nn.Sequential(conv(f"{name}_proj"), bn(f"{name}_proj_bn"))

        def forward(self, x: Any) -> Any:
            y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
            return torch.relu((x if self.proj is None else self.proj(x)) + y)

    class ResNet20(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.stem_bn = conv("stem"), bn("stem_bn")
            self.blocks = nn.Sequential(*(Block(f"s{s}b{b}") for s in (1, 2, 3) for b in (1, 2, 3)))
            kernel, bias = (np.asarray(w) for w in layers["head"].get_weights())
            self.head = nn.Linear(kernel.shape[0], kernel.shape[1])
            with torch.no_grad():
                self.head.weight.copy_(torch.from_numpy(kernel.T.copy()))
                self.head.bias.copy_(torch.from_numpy(bias))

        def forward(self, images: Any) -> Any:
            x = torch.relu(self.stem_bn(self.stem(images.permute(0, 3, 1, 2))))
            return self.head(self.blocks(x).mean(dim=(2, 3)))

    return ResNet20().eval()
