"""K-FAC and EKFAC where floating point decides: singular and graded factors, rounding in
the output Hessian, Monte Carlo labels under rebatching, bad data and NaN vectors.

Truths: the operator's dense matrix (``to_dense``, the Kronecker products placed in a
float64 array) with numpy ``eigh``/``slogdet``/``solve``, and exact reasoning on a single
linear layer under MSE, whose K-FAC is A ⊗ (2/d) I with A computed in numpy from the data.
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest

from spectra.operators.ekfac import EKFACOperator
from spectra.operators.kfac import KFACOperator

SPARSE = "sparse_categorical_crossentropy"


def _softmax_mlp(dtype, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(5, activation="tanh", dtype=dtype),
            keras.layers.Dense(3, activation="softmax", dtype=dtype),
        ]
    )


@pytest.fixture(scope="module")
def classification():
    rng = np.random.default_rng(1)
    return rng.normal(size=(50, 4)), rng.integers(0, 3, 50)


# -- 1. singular K: the softmax's all-ones null direction of the last layer's G ----------
@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_singular_kfac_is_refused_with_a_damping_that_works(classification, cls, dtype):
    x, labels = classification
    model = _softmax_mlp(dtype)
    op = cls.from_keras(model, SPARSE, (x.astype(dtype), labels), batch_size=10)
    # Truth: G of the last layer has the all-ones vector in its null space (softmax
    # cross-entropy at the logits), so K has one zero eigenvalue per eigenvalue of that
    # layer's A (6: five inputs and the bias); everything else is positive here.
    zeros = op.blocks[-1].A.shape[0]
    values = op.eigenvalues()
    assert np.count_nonzero(values == 0) == zeros
    assert values[-zeros - 1] > 1e-6 * values[0]  # the rest kept, not rounded away
    # Before: logdet(0) -294.9 (float32) / -380.4 (float64) and |inverse(0) @ 1| ~ 4e10 /
    # 2e18, numbers made of rounding.
    for method in (op.logdet, op.inverse):
        with pytest.raises(ValueError, match=rf"K \+ 0·I is singular: {zeros} of K's") as err:
            method(0.0)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="singular"):
        op.inverse(0.0) @ np.ones(op.shape[0])
    advice = re.search(r"e\.g\. damping=(\S+) ", str(err.value))
    assert advice is not None
    damping = float(advice.group(1))
    # Following the advice works, and gives the dense matrix's numbers.
    dense = op.to_dense()
    shifted = dense + damping * np.eye(len(dense))
    sign, logdet = np.linalg.slogdet(shifted)
    assert sign == 1
    assert op.logdet(damping) == pytest.approx(logdet, rel=1e-10)
    v = np.random.default_rng(0).normal(size=op.shape[0])
    np.testing.assert_allclose(
        op.inverse(damping).matvec(v), np.linalg.solve(shifted, v), rtol=1e-8
    )
    # A damping below the rounding bound is refused as well; one above it is taken.
    bound = float(re.search(r"pass damping > (\S+),", str(err.value)).group(1))
    with pytest.raises(ValueError, match="singular"):
        op.logdet(bound / 2)
    assert np.isfinite(op.logdet(2 * bound))


def test_the_message_names_no_dtype_dependent_eigenvalue(classification):
    x, labels = classification
    messages = []
    for dtype in ("float32", "float64"):
        op = KFACOperator.from_keras(_softmax_mlp(dtype), SPARSE, (x.astype(dtype), labels))
        with pytest.raises(ValueError) as err:
            op.logdet()
        messages.append(str(err.value))
    for message in messages:  # the zero eigenvalues are reported as 0, with their bound
        assert "6 of K's 43 eigenvalues are 0 (true size at most" in message


# -- 2. graded factors: inputs x 1e-30 beside the bias coordinate ----------------------
SCALE = 1e-30


@pytest.fixture(scope="module")
def graded():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,), dtype="float64"), keras.layers.Dense(3, dtype="float64")]
    )
    rng = np.random.default_rng(1)
    x0 = rng.normal(size=(20, 4))
    return model, x0, rng.normal(size=(20, 3))


def _graded_truth(x0):
    """A = (1/N) Σ ā āᵀ with ā = [s x; 1], from its exact structure: the eigenvalues are
    s² eig(cov x) (the Schur complement of the bias entry) and 1 + O(s²) = 1 in float64."""
    cov = np.cov(x0.T, bias=True)
    return np.r_[SCALE**2 * np.linalg.eigvalsh(cov), 1.0]


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_graded_factors_logdet_is_exact(graded, cls):
    model, x0, y = graded
    op = cls.from_keras(model, "mse", (x0 * SCALE, y), batch_size=7)
    np.testing.assert_allclose(op.blocks[0].G, (2 / 3) * np.eye(3), rtol=1e-14, atol=1e-16)
    alpha, gamma = _graded_truth(x0), np.full(3, 2 / 3)
    np.testing.assert_allclose(
        np.sort(op.eigenvalues()), np.sort(np.outer(alpha, gamma).ravel()), rtol=1e-12
    )
    dense = op.to_dense()
    for damping in (1e-70, 1e-62, 1e-3):
        truth = float(np.sum(np.log(np.outer(alpha, gamma) + damping)))
        # Before: -1802.9 (K-FAC) and -1668.6 (EKFAC) against -1669.3 at 1e-70.
        assert op.logdet(damping) == pytest.approx(truth, rel=1e-12)
        sign, logdet = np.linalg.slogdet(dense + damping * np.eye(len(dense)))
        assert sign == 1 and op.logdet(damping) == pytest.approx(logdet, rel=1e-12)


def test_graded_factors_inverse_is_exact(graded):
    model, x0, y = graded
    op = KFACOperator.from_keras(model, "mse", (x0 * SCALE, y), batch_size=7)
    damping, gamma = 1e-70, 2 / 3
    # Truth: (A ⊗ γI + δI)⁻¹ acts on the kernel-and-bias matrix M (5 x 3) as
    # (γA + δI)⁻¹ M; solved on its diagonally scaled form, which is well conditioned.
    abar = np.c_[x0 * SCALE, np.ones(len(x0))]
    shifted = gamma * abar.T @ abar / len(x0) + damping * np.eye(5)
    d = np.sqrt(np.diag(shifted))
    v = np.random.default_rng(3).normal(size=op.shape[0])
    M = np.concatenate([v[:12].reshape(4, 3), v[12:].reshape(1, 3)])
    X = np.linalg.solve(shifted / np.outer(d, d), M / d[:, None]) / d[:, None]
    truth = np.r_[X[:4].ravel(), X[4]]
    np.testing.assert_allclose(op.inverse(damping).matvec(v), truth, rtol=1e-9)


# -- 3. type-2: rounding of the output Hessian is not non-convexity --------------------
@pytest.fixture(scope="module")
def digits_subset():
    model = keras.models.load_model("data/digits_mlp.keras", compile=False)
    data = np.load("data/digits.npz")
    # Examples 16-23: on them, batch_size=4 was refused and batch_size=8 built.
    return model, data["x"][16:24], data["y"][16:24]


def test_type2_builds_the_readme_model_at_batch_4(digits_subset):
    model, x, y = digits_subset
    # Before: batch_size=4 refused as a "non-convex loss" (eigenvalue -1.75e-08, rounding
    # of p - p² judged against the batch), though it built at 8 (and 32).
    small = KFACOperator.from_keras(model, SPARSE, (x, y), batch_size=4)
    large = KFACOperator.from_keras(model, SPARSE, (x, y), batch_size=8)
    for a, b in zip(small.blocks, large.blocks):
        # A (257 wide) is summed in float32 (factors over 64 wide: see _gram) and G comes
        # from float32 backward passes: rounding differs with the batch shapes (A by
        # 3e-8 of its largest entry on an AVX2 machine, bit-identical on an AVX-512 one).
        np.testing.assert_allclose(a.A, b.A, rtol=0, atol=1e-6 * np.abs(b.A).max())
        np.testing.assert_allclose(a.G, b.G, rtol=0, atol=1e-5 * np.abs(b.G).max())


def test_type2_custom_loss_rounding_judged_over_the_dataset(digits_subset):
    model, x, y = digits_subset

    def custom(y_true, y_pred):  # not recognized as convex: the numeric check runs
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y_true, y_pred))

    op = KFACOperator.from_keras(model, custom, (x, y), batch_size=4)
    named = KFACOperator.from_keras(model, SPARSE, (x, y), batch_size=4)
    for a, b in zip(op.blocks, named.blocks):
        np.testing.assert_allclose(a.G, b.G, rtol=0, atol=1e-12 * np.abs(b.G).max())


def test_type2_refuses_a_loss_that_is_not_convex():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((2,), dtype="float64"), keras.layers.Dense(2, dtype="float64")]
    )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 2)), rng.normal(size=(6, 2))

    def wavy(y_true, y_pred):  # output Hessian -cos(z - y): indefinite
        return keras.ops.mean(keras.ops.cos(y_pred - y_true))

    with pytest.raises(ValueError, match="needs a loss convex in the model's outputs") as err:
        KFACOperator.from_keras(model, wavy, (x, y), batch_size=2)
    assert "\n" not in str(err.value)


# -- 4. errors as the exact operators give them ---------------------------------------
def _embedding_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(10, 4),
            keras.layers.Flatten(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(10, 4)
        self.flat = keras.layers.Flatten()
        self.head = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.head(self.flat(self.embed(x)))


TOKENS = np.array([[1, 2, 3], [4, 12, 1]])


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_out_of_range_index_and_label_are_one_line(cls):
    model = _embedding_model()
    with pytest.raises(
        ValueError, match=r"indices must lie in \[0, 10\), but x\[1, 1\] = 12"
    ) as err:
        cls.from_keras(model, SPARSE, (TOKENS, np.array([0, 1])))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"class indices in \[0, 3\).*y\[1\] = 7") as err:
        cls.from_keras(model, SPARSE, (TOKENS % 10, np.array([0, 7])))
    assert "\n" not in str(err.value)
    subclassed = _Subclassed()
    subclassed(TOKENS[:1])
    # No declared inputs to check before the pass: the layer's error, its cause first.
    with pytest.raises(
        Exception, match=r"^batch 0: indices\[1,1\] = 12 is not in \[0, 10\)"
    ) as err:
        cls.from_keras(subclassed, SPARSE, (TOKENS, np.array([0, 1])))
    assert "Exception encountered" not in str(err.value)


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_nan_vectors_are_refused_like_the_exact_operators(classification, cls):
    x, labels = classification
    op = cls.from_keras(_softmax_mlp("float64"), SPARSE, (x, labels))
    v = np.ones(op.shape[0])
    v[3] = np.nan
    inverse = op.inverse(1e-2)
    for name, call in (
        ("matvec", lambda: op.matvec(v)),
        ("matmat", lambda: op.matmat(v[:, None])),
        ("matvec", lambda: op @ v),
        ("inverse", lambda: inverse.matvec(v)),
        ("inverse", lambda: inverse @ np.c_[v, v]),
    ):
        with pytest.raises(ValueError, match=rf"^{name}: the input contains NaN or Inf\.$"):
            call()
    v[3] = np.inf
    with pytest.raises(ValueError, match="contains NaN or Inf"):
        inverse.matvec(v)


# -- 5. Monte Carlo labels per example: the matrix does not depend on the batching -----
@pytest.mark.parametrize(
    ("num_samples", "cls"),
    [
        # make test runs K-FAC with 2 samples per example and EKFAC (whose scalings pass
        # draws its own labels) with 1; make test-all all four.
        pytest.param(1, KFACOperator, marks=pytest.mark.long),
        pytest.param(1, EKFACOperator),
        pytest.param(2, KFACOperator),
        pytest.param(2, EKFACOperator, marks=pytest.mark.long),
    ],
    ids=["1-KFACOperator", "1-EKFACOperator", "2-KFACOperator", "2-EKFACOperator"],
)
def test_monte_carlo_kfac_does_not_depend_on_batch_size(classification, cls, num_samples):
    x, labels = classification
    x, labels = x[:7], labels[:7]
    model = _softmax_mlp("float64")
    dense = [
        cls.from_keras(
            model, SPARSE, (x, labels), batch_size=b, kind="mc", num_samples=num_samples, seed=3
        ).to_dense()
        for b in (1, 3, 7)
    ]
    # Before: 25 % apart between batch sizes (labels seeded by the batch index).
    for other in dense[:-1]:
        np.testing.assert_allclose(other, dense[-1], rtol=0, atol=1e-13 * np.abs(dense[-1]).max())
    other_seed = cls.from_keras(
        model, SPARSE, (x, labels), batch_size=7, kind="mc", num_samples=num_samples, seed=4
    ).to_dense()
    assert np.abs(other_seed - dense[-1]).max() > 1e-3 * np.abs(dense[-1]).max()
