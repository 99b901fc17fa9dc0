"""The JAX engine: per batch, a cached linearization; per product, one compiled call.

For a :class:`~spectra.operators.jax.curvature.Curvature` and a
:class:`~spectra.operators.jax.models.ModelProgram`, an :class:`Engine` holds three
functions, each jitted and compiled ahead of time **once per batch shape** (a short last
batch compiles once more, not once per product; :attr:`Engine.num_compiles` counts):

* ``prepare(θ, state, batch, key, N) -> (L_b, ∇L_b, cache)`` — the forward pass, the
  gradient and the cache of the batch: for the Hessian ``jax.linearize`` of the gradient
  (forward-over-reverse, Pearlmutter 1994), whose residuals (activations, the derivatives
  of the nonlinearities, the back-propagated signals) are the cache's leaves;
* ``apply(cache, v, w, total) -> total + w·C_b v`` — one product from a cache: one
  evaluation of the linearized function, no forward pass, no model call;
* ``apply_block(cache, V, w, total)`` — k products at once, ``jax.vmap`` of ``apply``.

The weighting by w = n_b/N and the running sum are part of the compiled product, so a
pass over the data is one asynchronous call per batch (and vector), read back once at its
end. A batch whose cache is not kept is prepared again in each pass, its cache dropped
after its products: compiling a separate gradient for the first pass would cost more
(about 0.3-0.6 s per compilation on the CPU) than computing the residuals it saves.
Arrays cross the boundary one per variable (never concatenated inside a compiled
function: on the CPU, XLA fused a concatenation of the gradient with the reductions that
produce it into a loop 6-10 times slower than the gradient itself).

**Costs measured** on this project's 2-core CPU, shared with other jobs (so ±20 %),
float32, one batch, G = one compiled gradient of the same loss:

* MLP 64-256-256-10 (85k parameters, tanh), 256 digits, G = 1.1-1.6 ms. Hessian:
  ``prepare`` (forward, gradient and the 3.3 MB of residuals) 1.3 G; one cached product
  1.9-2.1 G; blocks, per vector, a loop of single products 2.1-2.3 G for k = 4 and 16,
  2.4-2.8 G for k = 64, ``jax.vmap`` 1.8-2.2 G and 2.9-3.0 G. GGN: ``prepare`` 1.0 G, a
  product 1.4-1.5 G, loop 1.5-1.6 G (k = 4, 16) and 1.5-2.1 G (64), vmap 1.3 G and
  1.7-2.0 G. Compiling: ``prepare`` 0.4-0.6 s, ``apply`` 0.25-0.35 s.
* The test models (a 43-parameter tanh MLP on 20 examples, a 47-parameter CNN on 8):
  a call's overhead is the cost, G ≈ 40 µs and a product 5-7 G (0.2-0.3 ms from
  ``matvec`` to ``matvec``); blocks per vector, loop 3-4.7 G, vmap 0.1-2 G. Compiling:
  ``prepare`` 0.4-1.3 s, ``apply`` 0.2-0.75 s.

:data:`BLOCK_MODE` is therefore ``"loop"``: a block is a loop of single products,
dispatched asynchronously, one vector's tangents alive at a time, through one compiled
``apply`` per batch shape whatever the block size. ``vmap`` is no faster on the MLP
(slower at k = 64: the vmapped matrix products are batched GEMMs, and k vectors' tangents
are alive at once) and wins only where a vector costs about 0.1 ms either way, while it
would compile once more for every block size k.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal

from spectra import _jax_compat
from spectra.operators.jax.curvature import BatchProblem, Curvature
from spectra.operators.jax.models import ModelProgram

__all__ = ["BLOCK_MODE", "Compiled", "Engine", "cached_engine", "nbytes"]

#: How a block of vectors is multiplied: ``"loop"`` (single products one after another)
#: or ``"vmap"`` (one compiled call for a sub-block); see the module docstring.
BLOCK_MODE = "loop"


def nbytes(tree: Any) -> int:
    """Bytes of the arrays of a pytree (a cache: its residuals)."""
    return sum(int(getattr(leaf, "nbytes", 0)) for leaf in jax.tree.leaves(tree))


def _signature(args: Sequence[Any]) -> Hashable:
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((np.shape(leaf), _dtype_of(leaf)) for leaf in leaves)


def _dtype_of(leaf: Any) -> Any:
    dtype = getattr(leaf, "dtype", None)
    return np.asarray(leaf).dtype if dtype is None else dtype


class Compiled:
    """``fn`` jitted, traced and compiled ahead of time once per argument signature (the
    structure, shapes and dtypes of its arguments).

    ``float64``: trace under :func:`spectra._jax_compat.exact_float64` and refuse (one
    line naming the layer and the operation) a traced computation with floating values
    of fewer than 64 bits. ``inspect(jaxpr)`` runs on each new trace.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        *,
        float64: bool,
        inspect: Callable[[Any], None] | None = None,
    ) -> None:
        self.name = name
        self._jitted = jax.jit(fn)
        self._float64 = float64
        self._inspect = inspect
        self._by_signature: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        self.num_compiles = 0

    def executable(self, *args: Any) -> Any:
        """The compiled function for these arguments' signature (compiled now if new)."""
        key = _signature(args)
        found = self._by_signature.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._by_signature.get(key)
            if found is not None:
                return found
            exact = _jax_compat.exact_float64() if self._float64 else contextlib.nullcontext()
            with exact:
                traced = self._jitted.trace(*args)
            if self._float64:
                low = _jax_compat.low_precision_ops(traced.jaxpr)
                if low:
                    raise TypeError(
                        f"dtype=float64: Keras {_keras_version()} on JAX computes "
                        f"{'; '.join(low[:3])} in fewer than 64 bits, so the products would "
                        "not be float64-accurate. Build the operator with dtype=np.float32, "
                        "or on KERAS_BACKEND=tensorflow."
                    )
            if self._inspect is not None:
                self._inspect(traced.jaxpr)
            found = traced.lower().compile()
            self._by_signature[key] = found
            self.num_compiles += 1
            return found

    def __call__(self, *args: Any) -> Any:
        return self.executable(*args)(*args)


def _keras_version() -> str:
    import keras

    return str(keras.__version__)


def unreached_inputs(jaxpr: Any, inputs: Sequence[int], output: int) -> list[int]:
    """The positions among ``inputs`` (indices of ``jaxpr``'s inputs) that output number
    ``output`` does not depend on (an equation counts as depending on all its inputs)."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    needed: set[Any] = set()
    target = inner.outvars[output]
    if not isinstance(target, Literal):
        needed.add(target)
    for eqn in reversed(inner.eqns):
        if any(var in needed for var in eqn.outvars):
            needed.update(v for v in eqn.invars if not isinstance(v, Literal))
    return [i for i in inputs if inner.invars[i] not in needed]


class Engine:
    """The compiled functions of one curvature on one model program (see the module
    docstring), shared by every operator built on the same model, loss, options and
    dtype: an operator's state (its snapshot, its caches) is passed in, never kept here."""

    def __init__(
        self,
        curvature: Curvature,
        program: ModelProgram,
        *,
        allow_unused: bool,
        names: Sequence[str] | None = None,
    ):
        self.curvature = curvature
        self.program = program
        self.allow_unused = allow_unused
        self.dtype = program.dtype
        float64 = self.dtype == np.float64
        # The user's names of the parameters (a compute copy's paths may differ).
        self.names = list(names) if names is not None else program.parameter_names()
        self.shapes = program.parameter_shapes()
        self.size = int(sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes))
        self.block_mode = BLOCK_MODE
        self._checked_unused = False
        self.prepare = Compiled(
            self._prepare, "prepare", float64=float64, inspect=self._check_unused
        )
        self.apply = Compiled(self._apply, "apply", float64=float64)
        self.apply_block = Compiled(self._apply_block, "apply_block", float64=float64)

    @property
    def num_compiles(self) -> int:
        """Compilations so far, all functions together (one per function and batch shape)."""
        return sum(f.num_compiles for f in (self.prepare, self.apply, self.apply_block))

    # -- the traced functions -----------------------------------------------------------
    def _problem(self, params: Any, state: Any, batch: Any, key: Any, count: Any) -> BatchProblem:
        return BatchProblem(
            self.program, params, state, batch, jax.random.wrap_key_data(key), count
        )

    def _prepare(self, params: Any, state: Any, batch: Any, key: Any, count: Any) -> Any:
        with _jax_compat.keras_logits():
            problem = self._problem(params, state, batch, key, count)
            return self.curvature.prepare(problem)

    def _apply(self, cache: Any, vector: Any, weight: Any, total: Any) -> Any:
        product = self.curvature.apply(cache, list(vector))
        return [t + weight * p for t, p in zip(total, product)]

    def _apply_block(self, cache: Any, block: Any, weight: Any, total: Any) -> Any:
        products = jax.vmap(lambda v: self.curvature.apply(cache, list(v)))(list(block))
        return [t + weight * p for t, p in zip(total, products)]

    # -- checks ----------------------------------------------------------------------------
    def _check_unused(self, jaxpr: Any) -> None:
        """Refuse (or warn about, with ``allow_unused``) parameters the batch loss does not
        depend on, once: ``prepare``'s first output is the loss, its first inputs θ."""
        if self._checked_unused:
            return
        self._checked_unused = True
        unused = [self.names[i] for i in unreached_inputs(jaxpr, range(len(self.names)), output=0)]
        if unused and not self.allow_unused:
            raise ValueError(
                f"these variables do not affect the loss: {unused}. Pass variables without "
                "them (e.g. only the layers the loss uses), or allow_unused=True to keep "
                "them as zero rows and columns of the matrix."
            )
        if unused:
            warnings.warn(
                f"variables {unused} do not affect the loss; their rows and columns of the "
                f"{self.curvature.title} matrix are zero.",
                stacklevel=2,
            )


_CACHE_SIZE = 8
_engines: collections.OrderedDict[Hashable, tuple[tuple[Any, ...], Engine]] = (
    collections.OrderedDict()
)
_engines_lock = threading.Lock()


def cached_engine(key: Hashable, owners: tuple[Any, ...], build: Callable[[], Engine]) -> Engine:
    """The engine stored under ``key`` (checked against the objects it names by identity,
    which the entry keeps alive), or a new one; a few are kept, least recently used go
    first."""
    with _engines_lock:
        entry = _engines.get(key)
        if entry is not None and all(a is b for a, b in zip(entry[0], owners)):
            _engines.move_to_end(key)
            return entry[1]
    engine = build()
    with _engines_lock:
        _engines[key] = (owners, engine)
        _engines.move_to_end(key)
        while len(_engines) > _CACHE_SIZE:
            _engines.popitem(last=False)
    return engine
