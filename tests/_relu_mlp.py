"""Independent float64 truths for ReLU MLPs under softmax cross-entropy, in NumPy only.

For a Keras ``Sequential`` of ``Dense`` layers (ReLU hidden layers, a softmax or linear
output read as logits z) and the mean cross-entropy L = (1/N) Σ_n −log softmax(z_n)[y_n]:

* :meth:`ReluMLP.hvp`: exact Hessian-vector products by Pearlmutter's R-operator (1994),
  written out by hand: a forward pass of directional derivatives, then the derivative of
  the backward pass. Nothing of TensorFlow or spectra is used.
* :meth:`ReluMLP.trace`: the exact trace in closed form. z is piecewise linear in the
  weights of any single layer (ReLU is piecewise linear), so ∂²z/∂θ_i² = 0 almost everywhere
  and diag(H) = diag(G), G the Gauss-Newton matrix. With B_l = ∂z/∂h_l (C × d_l, h_l the
  pre-activation of layer l) and a_{l−1} its input, ∂z/∂W_l[i, j] = a_{l−1}[i] B_l[:, j], so

      tr H = (1/N) Σ_n Σ_l (‖a_{l−1,n}‖² + 1) · tr(B_{l,n}ᵀ H_z,n B_{l,n}),
      H_z = diag(p) − p pᵀ,

  (the +1 is the bias), at the cost of one forward and one backward pass of C × d matrices.

Parameters are ordered as Keras orders ``trainable_variables``: kernel (in, out) row-major,
then bias, layer by layer.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse.linalg import LinearOperator


class ReluMLP:
    """The loss Hessian of a ReLU MLP with softmax cross-entropy, as NumPy float64."""

    def __init__(self, weights: list[np.ndarray], x: np.ndarray, y: np.ndarray):
        if len(weights) % 2:
            raise ValueError("expected kernel, bias pairs")
        self.kernels = [np.asarray(w, np.float64) for w in weights[0::2]]
        self.biases = [np.asarray(b, np.float64) for b in weights[1::2]]
        self.shapes = [w.shape for w in weights]
        self.n = int(sum(np.prod(s) for s in self.shapes))
        self.x = np.asarray(x, np.float64).reshape(len(x), -1)
        self.y = np.asarray(y).reshape(-1).astype(np.int64)
        self.num_examples = self.x.shape[0]
        # Forward pass: inputs a_{l-1} of every layer, ReLU masks, probabilities.
        self.inputs, self.masks = [], []
        a = self.x
        for kernel, bias in zip(self.kernels[:-1], self.biases[:-1]):
            self.inputs.append(a)
            h = a @ kernel + bias
            self.masks.append((h > 0).astype(np.float64))
            a = np.maximum(h, 0.0)
        self.inputs.append(a)
        logits = a @ self.kernels[-1] + self.biases[-1]
        logits -= logits.max(axis=1, keepdims=True)
        e = np.exp(logits)
        self.p = e / e.sum(axis=1, keepdims=True)
        self.onehot = np.eye(self.p.shape[1])[self.y]

    @classmethod
    def from_keras(cls, model, x, y) -> ReluMLP:
        return cls([np.asarray(w) for w in model.get_weights()], x, y)

    def loss(self) -> float:
        return float(-np.mean(np.log(self.p[np.arange(self.num_examples), self.y])))

    def gradient(self) -> np.ndarray:
        """∇L by backpropagation, flattened in Keras' order."""
        delta = (self.p - self.onehot) / self.num_examples
        parts: list[np.ndarray] = []
        for layer in range(len(self.kernels) - 1, -1, -1):
            parts[:0] = [(self.inputs[layer].T @ delta).reshape(-1), delta.sum(axis=0)]
            if layer:
                delta = (delta @ self.kernels[layer].T) * self.masks[layer - 1]
        return np.concatenate(parts)

    def _unflatten(self, v: np.ndarray) -> list[np.ndarray]:
        pieces = np.split(v, np.cumsum([int(np.prod(s)) for s in self.shapes])[:-1])
        return [piece.reshape(shape) for piece, shape in zip(pieces, self.shapes)]

    def hvp(self, v: np.ndarray) -> np.ndarray:
        """H v by the R-operator: R{·} is the directional derivative along v."""
        parts = self._unflatten(np.asarray(v, np.float64).reshape(-1))
        dkernels, dbiases = parts[0::2], parts[1::2]
        count = len(self.kernels)
        # R-forward: directional derivatives of the pre-activations and activations.
        r_inputs = [np.zeros_like(self.x)]
        for layer in range(count - 1):
            r_h = (
                r_inputs[layer] @ self.kernels[layer]
                + self.inputs[layer] @ dkernels[layer]
                + dbiases[layer]
            )
            r_inputs.append(r_h * self.masks[layer])
        r_z = r_inputs[-1] @ self.kernels[-1] + self.inputs[-1] @ dkernels[-1] + dbiases[-1]
        # Backward pass δ = ∂L/∂h and its R-derivative, layer by layer from the output.
        delta = (self.p - self.onehot) / self.num_examples
        r_p = self.p * (r_z - np.sum(self.p * r_z, axis=1, keepdims=True))
        r_delta = r_p / self.num_examples
        out: list[np.ndarray] = [None] * (2 * count)  # type: ignore[list-item]
        for layer in range(count - 1, -1, -1):
            out[2 * layer] = r_inputs[layer].T @ delta + self.inputs[layer].T @ r_delta
            out[2 * layer + 1] = r_delta.sum(axis=0)
            if layer:
                mask = self.masks[layer - 1]
                r_delta, delta = (
                    (r_delta @ self.kernels[layer].T + delta @ dkernels[layer].T) * mask,
                    (delta @ self.kernels[layer].T) * mask,
                )
        return np.concatenate([o.reshape(-1) for o in out])

    def operator(self) -> LinearOperator:
        return LinearOperator((self.n, self.n), matvec=self.hvp, dtype=np.float64)

    def dense(self) -> np.ndarray:
        """The n × n Hessian, column by column (small models only)."""
        return np.stack([self.hvp(e) for e in np.eye(self.n)], axis=1)

    def trace(self) -> float:
        """tr H in closed form (see the module docstring)."""
        count = len(self.kernels)
        classes = self.p.shape[1]
        # B_l per example, (N, C, d_l); the output layer's B is the identity.
        b = np.broadcast_to(np.eye(classes), (self.num_examples, classes, classes))
        total = 0.0
        for layer in range(count - 1, -1, -1):
            # tr(Bᵀ H_z B) = Σ_j (Σ_k p_k B_kj² − (Σ_k p_k B_kj)²)
            weighted = np.einsum("nk,nkj->nj", self.p, b)
            quadratic = np.einsum("nk,nkj->n", self.p, b**2) - np.sum(weighted**2, axis=1)
            norms = np.sum(self.inputs[layer] ** 2, axis=1) + 1.0
            total += float(np.sum(norms * quadratic))
            if layer:
                b = (
                    np.einsum("nkj,ij->nki", b, self.kernels[layer])
                    * self.masks[layer - 1][:, None, :]
                )
        return total / self.num_examples
