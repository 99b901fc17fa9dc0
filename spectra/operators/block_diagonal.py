"""The block-diagonal approximation of a linear operator, as a LinearOperator.

For a partition of the indices into blocks b (index sets I_b, P_b the diagonal 0/1
projector onto them), the block-diagonal part of C is

    D = Σ_b P_b C P_b,      D v = Σ_b P_b (C (P_b v)),

so a product of D costs one product of C per block (the masked vector P_b v) and one
block of k vectors is one ``matmat`` of C with the k · (number of blocks) masked columns,
one data pass of a Hessian for all blocks (the per-layer trick of
:mod:`spectra.analysis.per_layer`). Masked columns that are zero (a vector with no entry
in a block) are not multiplied. D is symmetric when C is, and its eigenvalues are the
union of the eigenvalues of the blocks C[I_b][:, I_b].

The blocks are, by default, the layers of a spectra curvature operator: the runs of
consecutive variables that share the parent of their Keras path, a run ending where a
path repeats (:func:`layer_groups`, so two layers with the same path stay two blocks; the
grouping that
:func:`spectra.layerwise` uses), from ``op.variable_names`` and ``op.variable_shapes``;
or explicit index blocks (``groups``) or contiguous ``block_sizes`` for any operator.
NumPy and SciPy only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy.sparse.linalg import LinearOperator

from spectra._validation import check_int
from spectra.operators.submatrix import as_operator, index_array

__all__ = ["BlockDiagonalOperator", "layer_groups"]


def layer_groups(paths: Sequence[str]) -> tuple[list[str], list[list[int]]]:
    """One group per Keras layer: each run of consecutive variables whose paths share
    their parent, a run ending where a path repeats.

    ``"net/hidden/kernel"`` and ``"net/hidden/bias"`` form the group ``"net/hidden"``
    (a path without "/" is its own group). Keras orders a model's variables layer by
    layer, so a layer's variables are consecutive and their paths distinct; two layers
    whose variables have the same paths (a subclassed model with two Dense layers both
    named "d": ``m/d/kernel, m/d/bias, m/d/kernel, m/d/bias``) are two runs, the second
    starting at the repeated ``m/d/kernel``, hence two groups, never merged: the
    second and later ones are named ``"m/d#2"``, ``"m/d#3"``, …. When every group name
    starts with the same first component (``"net/"``) and the names stay distinct without
    it, it is dropped: ``"hidden"``. Returns the group names in order and, per group, the
    positions of its variables in ``paths``.
    """
    keys: list[str] = []
    members: list[list[int]] = []
    current: set[str] = set()  # the paths of the current run
    for position, path in enumerate(paths):
        key = path.rpartition("/")[0] or path
        if keys and keys[-1] == key and path not in current:
            members[-1].append(position)
        else:  # another parent, or a path seen in this run again: the next layer
            keys.append(key)
            members.append([position])
            current = set()
        current.add(path)
    names: list[str] = []
    seen: dict[str, int] = {}
    for key in keys:
        seen[key] = seen.get(key, 0) + 1
        name = key if seen[key] == 1 else f"{key}#{seen[key]}"
        while name in names:  # a real path spelled like a suffixed one
            seen[key] += 1
            name = f"{key}#{seen[key]}"
        names.append(name)
    # "sequential/dense", "sequential/dense_1" -> "dense", "dense_1"
    firsts = {name.partition("/")[0] for name in names}
    if len(firsts) == 1 and all("/" in name for name in names):
        short = [name.partition("/")[2] for name in names]
        if len(set(short)) == len(short):
            names = short
    return names, members


def _layer_blocks(op: LinearOperator, n: int) -> tuple[list[str], list[np.ndarray]]:
    """The parameter indices of each layer of a curvature operator."""
    names = getattr(op, "variable_names", None)
    shapes = getattr(op, "variable_shapes", None)
    if names is None or shapes is None:
        raise ValueError(
            f"BlockDiagonalOperator: {type(op).__name__} has no variable_names/variable_shapes "
            "to find its layers: pass groups (lists of indices) or block_sizes"
        )
    sizes = [math.prod(shape) for shape in shapes]
    if sum(sizes) != n:
        raise ValueError(
            f"BlockDiagonalOperator: the operator's variables have {sum(sizes)} entries but "
            f"its dimension is {n}"
        )
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    group_names, members = layer_groups(list(names))
    blocks = [
        np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in member])
        for member in members
    ]
    return group_names, blocks


def _given_blocks(groups: Any, n: int) -> tuple[list[str], list[np.ndarray]]:
    if isinstance(groups, (str, bytes)) or not isinstance(groups, (Mapping, Sequence)):
        raise TypeError(
            "BlockDiagonalOperator: groups must be a list of index lists or a mapping of "
            f"names to index lists, got {type(groups).__name__}"
        )
    if not groups:
        raise ValueError("BlockDiagonalOperator: groups is empty")
    if isinstance(groups, Mapping):
        names = [str(key) for key in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"BlockDiagonalOperator: group names must be distinct, got {names}")
        values = list(groups.values())
    else:
        names = [f"block_{b}" for b in range(len(groups))]
        values = list(groups)
    keys = list(groups) if isinstance(groups, Mapping) else list(range(len(values)))
    blocks = [index_array(f"groups[{key!r}]", value, n) for key, value in zip(keys, values)]
    owner = np.full(n, -1)
    for b, block in enumerate(blocks):
        taken = block[owner[block] >= 0]
        if taken.size:
            raise ValueError(
                f"BlockDiagonalOperator: index {int(taken[0])} is in groups "
                f"{names[int(owner[taken[0]])]!r} and {names[b]!r}: groups must not overlap"
            )
        owner[block] = b
    missing = np.flatnonzero(owner < 0)
    if missing.size:
        raise ValueError(
            f"BlockDiagonalOperator: {missing.size} of the {n} indices are in no group (the "
            f"first is {int(missing[0])}): groups must cover range({n}); put the rest in a "
            "group of its own"
        )
    return names, blocks


def _sized_blocks(block_sizes: Any, n: int) -> tuple[list[str], list[np.ndarray]]:
    if isinstance(block_sizes, (str, bytes)) or np.ndim(block_sizes) != 1:
        raise TypeError(
            "BlockDiagonalOperator: block_sizes must be a list of positive integers, got "
            f"{type(block_sizes).__name__}"
        )
    sizes = [check_int(f"block_sizes[{b}]", size) for b, size in enumerate(block_sizes)]
    if not sizes:
        raise ValueError("BlockDiagonalOperator: block_sizes is empty")
    if sum(sizes) != n:
        raise ValueError(
            f"BlockDiagonalOperator: block_sizes sum to {sum(sizes)}, but the operator's "
            f"dimension is {n}: they must add up to it"
        )
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    blocks = [np.arange(offsets[b], offsets[b + 1]) for b in range(len(sizes))]
    return [f"block_{b}" for b in range(len(sizes))], blocks


class BlockDiagonalOperator(LinearOperator):
    """D = Σ_b P_b C P_b, the block-diagonal part of a square operator C.

    Cost: one product of C per block and vector, D V for k vectors in one ``matmat`` of
    C with the k · (number of blocks) masked columns P_b v_j (zero columns skipped, so a
    vector inside one block costs one product); for a spectra curvature operator that is
    one data pass for all blocks. Host memory: the masked block and its image, 2 · n · k ·
    (number of blocks) numbers. The adjoint is the block-diagonal part of Cᵀ (through
    ``C.rmatmat``), so D is symmetric when C is, and the estimators accept it; its
    eigenvalues are the union of those of the blocks C[I_b][:, I_b].

    Parameters
    ----------
    op
        the square matrix C: a LinearOperator (a :class:`~spectra.HessianOperator`, ...)
        or a 2-D array, n × n.
    groups
        the index blocks I_b: a list of lists (or 1-D arrays) of distinct integer indices,
        or a mapping of block names to them; together they must cover range(n) once.
        Default (with ``block_sizes`` None): the layers of a spectra curvature operator
        (:func:`layer_groups` of ``op.variable_names``).
    block_sizes
        instead of ``groups``: the sizes of contiguous blocks, adding up to n.

    Attributes
    ----------
    op : LinearOperator
        C.
    groups : list of numpy.ndarray
        the indices of each block.
    group_names : list of str
        the layer names, the mapping's keys, or "block_0", "block_1", ...

    Raises
    ------
    TypeError
        ``op`` is not an operator or array, or ``groups``/``block_sizes`` have the wrong type.
    ValueError
        C is not square; blocks overlap, miss an index or are out of range; block sizes do
        not add up to n; both ``groups`` and ``block_sizes`` given; no layers to default to.
    """

    def __init__(self, op: Any, groups: Any = None, block_sizes: Any = None) -> None:
        self.op = as_operator(op, "BlockDiagonalOperator")
        n, columns = self.op.shape
        if n != columns:
            raise ValueError(f"BlockDiagonalOperator: op must be square, got shape {self.op.shape}")
        if groups is not None and block_sizes is not None:
            raise ValueError("BlockDiagonalOperator: give groups or block_sizes, not both")
        if block_sizes is not None:
            names, blocks = _sized_blocks(block_sizes, n)
        elif groups is not None:
            names, blocks = _given_blocks(groups, n)
        else:
            names, blocks = _layer_blocks(self.op, n)
        self.group_names: list[str] = names
        self.groups: list[np.ndarray] = blocks
        super().__init__(dtype=np.dtype(self.op.dtype), shape=(n, n))

    @property
    def num_blocks(self) -> int:
        """The number of blocks."""
        return len(self.groups)

    def _apply(self, X: np.ndarray, adjoint: bool) -> np.ndarray:
        X = np.asarray(X)
        k = X.shape[1]
        dtype = np.result_type(X.dtype, self.dtype)
        # One masked column per (block, vector) with an entry in the block.
        columns = [
            (b, j) for b, block in enumerate(self.groups) for j in range(k) if np.any(X[block, j])
        ]
        out = np.zeros((self.shape[0], k), dtype=dtype)
        if not columns:
            return out
        masked = np.zeros((self.shape[0], len(columns)), dtype=dtype)
        for c, (b, j) in enumerate(columns):
            masked[self.groups[b], c] = X[self.groups[b], j]
        images = np.asarray(self.op.rmatmat(masked) if adjoint else self.op.matmat(masked))
        for c, (b, j) in enumerate(columns):
            out[self.groups[b], j] = images[self.groups[b], c]
        return out

    def _matmat(self, X: np.ndarray) -> np.ndarray:
        return self._apply(X, adjoint=False)

    def _rmatmat(self, X: np.ndarray) -> np.ndarray:
        return self._apply(X, adjoint=True)

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self._apply(np.asarray(x).reshape(-1, 1), adjoint=False).reshape(-1)

    def _rmatvec(self, x: np.ndarray) -> np.ndarray:
        return self._apply(np.asarray(x).reshape(-1, 1), adjoint=True).reshape(-1)

    def _adjoint(self) -> BlockDiagonalOperator:
        return BlockDiagonalOperator(self.op.H, groups=dict(zip(self.group_names, self.groups)))

    def block(self, index: int) -> np.ndarray:
        """The dense block C[I_b][:, I_b] of block ``index``: len(I_b) products of C in one
        ``matmat``, len(I_b)² host memory."""
        index = check_int("index", index, minimum=0)
        if index >= self.num_blocks:
            raise ValueError(
                f"index must be < {self.num_blocks} (the number of blocks), got {index}"
            )
        block = self.groups[index]
        unit = np.zeros((self.shape[0], block.size), dtype=self.dtype)
        unit[block, np.arange(block.size)] = 1
        return np.asarray(self.op.matmat(unit))[block]

    def to_dense(self) -> np.ndarray:
        """The dense n × n matrix D (zeros outside the blocks): n products of C, one
        ``matmat`` per block, and n² host memory; for small models and tests."""
        dense = np.zeros(self.shape, dtype=self.dtype)
        for b, block in enumerate(self.groups):
            dense[np.ix_(block, block)] = self.block(b)
        return dense

    def __repr__(self) -> str:
        return (
            f"<{self.shape[0]}x{self.shape[1]} BlockDiagonalOperator of "
            f"{type(self.op).__name__} with {self.num_blocks} blocks>"
        )
