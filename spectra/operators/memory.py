"""The memory model of a curvature operator: its budget, sub-blocks and plan.

An operator holds, besides the model itself:

* the **snapshot**: one copy of the parameters (n numbers) per local replica;
* the **batch caches** it keeps (each batch's frontier tensors: activations, masks,
  back-propagated signals), at most the cache budget; a batch that does not fit is
  *streamed*: its cache is recomputed in every pass and lives while its products run;
* per **block product** of k vectors: the tangents of the vector-dependent part for the
  vectors in flight, and the block's (k, n) arrays (:func:`product_bytes`). On a batch
  whose cache is at least :data:`LOOP_BLOCK_BYTES`, the block's vectors run one after
  another through the single-vector product (one vector's tangents alive at a time: on
  ResNet-20 a block of 4 as one ``tf.map_fn`` held 1.7 GiB of tangents against 1.0 GiB for
  one vector, at the same time per vector); on smaller batches, where a call's overhead
  is what a vector costs, the compiled block product, a ``tf.map_fn`` running at most
  :data:`PARALLEL_VECTORS` of them at once (the results are bitwise the same).
* **One vector's tangents** are measured on the operator's first product, from
  TensorFlow's allocator statistics of the device (``tf.config.experimental``'s
  ``reset_memory_stats`` and ``get_memory_info``, which count the CPU's allocations as
  well as a GPU's): the growth of the peak over the memory in use before the call, per
  vector in flight. Before that product, or where the statistics are not available, they
  are estimated as :data:`TANGENT_FACTOR` times the bytes of one batch's frontier (a
  product's second backward creates, per stored frontier tensor, a tangent of the same
  shape, plus the workspaces of its kernels). Measured per vector, in units of one
  batch's frontier: 1.06 on a two-convolution CNN, 0.65 on ResNet-20 and 0.26 on a
  two-block GPT (whose frontier holds the attention's saved tensors, most of which the
  tangents do not copy); the factor, an upper estimate, is what a first plan assumes.

A block larger than the sub-block size is multiplied in sub-blocks, one after another on
each batch of the same pass over the data, so that one sub-block's product memory + the
kept caches + one streamed batch + the snapshot stay within the budget.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

__all__ = [
    "BLOCK_COPIES",
    "DEFAULT_MEMORY_FRACTION",
    "LOOP_BLOCK_BYTES",
    "PARALLEL_VECTORS",
    "TANGENT_FACTOR",
    "KFACMemoryPlan",
    "MemoryPlan",
    "available_memory",
    "cache_share",
    "default_memory_budget",
    "format_bytes",
    "product_bytes",
    "sub_block_size",
]

#: Fraction of the memory available to the process (or of the accelerator's memory) that
#: an operator's default ``memory_budget`` takes.
DEFAULT_MEMORY_FRACTION = 0.5
#: Arrays of shape (k, n) a block product holds: the input block's host and device
#: copies, the running sums, and one batch's product during the pass, or the host
#: result and its transposed copy after it.
BLOCK_COPIES = 5
#: Vectors of a block whose products run at once (``tf.map_fn``'s ``parallel_iterations``).
PARALLEL_VECTORS = 10
#: One vector's tangents in a product, in units of one batch's cache, until measured
#: (see above).
TANGENT_FACTOR = 1.15
#: Batch caches of at least this many bytes run a block's vectors one at a time. Below
#: it, the compiled block is faster (digits MLP, 0.2 MiB: 1.8x); above, a vector costs
#: the same either way (MLP 64-256-256-10 at 0.8 to 11 MiB, a CNN at 14 MiB, ResNet-20
#: and the GPT at 1.5 GiB: 0.93x to 1.03x) and holds one vector's tangents, not several.
LOOP_BLOCK_BYTES = 4 * 1024**2
#: The largest sub-block; larger blocks gain no speed on the measured models.
LARGEST_SUB_BLOCK = 64


def _meminfo_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


#: Per engine, its compat module and the function there that reads the accelerator's memory.
_DEVICE_MEMORY = {
    "tensorflow": ("spectra._tf_compat", "first_gpu_memory"),
    "jax": ("spectra._jax_compat", "first_device_memory"),
}


def _gpu_memory() -> int | None:
    """Total memory of the first accelerator (GPU) in bytes, or None without one.

    Read by the compat module of the engine of Keras' backend (``spectra._tf_compat`` or
    ``spectra._jax_compat``), which the operator asking has loaded: this module imports
    neither, so that it serves both engines and the JAX engine never imports TensorFlow.
    None when that module is not loaded (no operator of that engine has been built).
    """
    from spectra._backend import configured_backend

    module, function = _DEVICE_MEMORY.get(configured_backend(), _DEVICE_MEMORY["tensorflow"])
    compat = sys.modules.get(module)
    lookup = getattr(compat, function, None)
    return None if lookup is None else lookup()


def available_memory() -> int:
    """Bytes available to this process: the first GPU's memory when there is one, else
    ``MemAvailable`` (Linux), else free pages (``os.sysconf``), else physical memory,
    else 4 GiB."""
    gpu = _gpu_memory()
    if gpu:
        return gpu
    available = _meminfo_available()
    if available:
        return available
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            value = os.sysconf("SC_PAGE_SIZE") * os.sysconf(pages)
        except (AttributeError, ValueError, OSError):
            continue
        if value > 0:
            return int(value)
    return 4 * 1024**3


def default_memory_budget() -> int:
    """:data:`DEFAULT_MEMORY_FRACTION` (one half) of :func:`available_memory`."""
    return int(available_memory() * DEFAULT_MEMORY_FRACTION)


def product_bytes(k: int, per_vector: int, per_row: int, parallel: int = PARALLEL_VECTORS) -> int:
    """Memory of a block product of k vectors, ``per_row`` = n·itemsize: min(k,
    ``parallel``) vectors' tangents (``per_vector`` each; ``parallel`` is 1 where a block
    runs one vector at a time) and :data:`BLOCK_COPIES` (k, n) arrays (an upper estimate:
    while the tangents are alive, one of those arrays is not yet allocated)."""
    return min(k, parallel) * per_vector + BLOCK_COPIES * k * per_row


def sub_block_size(
    per_vector: int,
    room: int,
    largest: int = LARGEST_SUB_BLOCK,
    per_row: int = 0,
    parallel: int = PARALLEL_VECTORS,
) -> int:
    """The largest power of two k ≤ ``largest`` whose :func:`product_bytes` fit ``room``
    (at least 1)."""
    k = 1
    while 2 * k <= largest and product_bytes(2 * k, per_vector, per_row, parallel) <= room:
        k *= 2
    return k


def cache_share(
    budget: int, snapshot: int, cache_per_batch: int, transient: int, per_row: int
) -> int:
    """The default room of the kept caches (``cache_bytes``), set from the first batch of
    the first pass: the budget less the snapshot and a reserve for the larger of the
    computation of a batch's cache (its measured ``transient``) and a product on a
    streamed batch (its cache, one vector's tangents estimated at :data:`TANGENT_FACTOR`
    times it, and the :data:`BLOCK_COPIES` arrays of one vector). Products need no more:
    a block runs in sub-blocks in what is left, and on large batches its vectors run one
    at a time anyway, at the same cost per vector."""
    streamed = cache_per_batch + int(TANGENT_FACTOR * cache_per_batch)
    reserve = max(transient, streamed) + BLOCK_COPIES * per_row
    return max(0, budget - snapshot - reserve)


def format_bytes(n: float) -> str:
    """``1.2 GiB``, ``340 MiB``, ``12 KiB`` or ``512 B``."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class MemoryPlan:
    """What an operator will hold in memory, in bytes (see :mod:`spectra.operators.memory`).

    ``budget``: the memory budget; ``snapshot``: the parameter copies (n numbers per local
    replica); ``cache_per_batch``: the largest batch cache; ``cached``: bytes of the kept
    caches; ``cached_batches``/``streamed_batches``: how many batches (of this process) are
    kept and recomputed per pass; ``per_vector``: the tangents of one vector in flight
    (measured on the first product, else :data:`TANGENT_FACTOR` times one batch's
    frontier; ``per_vector_measured`` says which); ``parallel``: the vectors of a block in
    flight at once (1 where they run one at a time); ``per_row``: one row of
    the block's (k, n) arrays (n·itemsize); ``block_size``: vectors per sub-block of the
    planned product; ``cache_transient``: the growth of the peak while one batch's cache
    is computed (its forward pass and gradient, and the cache they leave), measured on the
    first pass (0 where the device keeps no allocator statistics); ``peak``: the
    estimated peak (see :attr:`peak`); ``measured``: False until the first pass over the
    data (the batch figures are then 0).
    """

    budget: int
    snapshot: int
    cache_per_batch: int
    cached: int
    cached_batches: int
    streamed_batches: int
    per_vector: int
    per_row: int
    block_size: int
    measured: bool
    parallel: int = PARALLEL_VECTORS
    per_vector_measured: bool = False
    cache_transient: int = 0

    @property
    def products(self) -> int:
        """Bytes of one sub-block's product (:func:`product_bytes`)."""
        return product_bytes(self.block_size, self.per_vector, self.per_row, self.parallel)

    @property
    def streaming_batch(self) -> int:
        """Bytes of the one streamed batch cache alive at a time (0 when all are kept)."""
        return self.cache_per_batch if self.streamed_batches else 0

    @property
    def computing_cache(self) -> int:
        """Bytes while a batch's cache is computed: the kept caches (less the one being
        computed, on the first pass of an operator that streams none) and the
        computation's transient."""
        overlap = self.cache_per_batch if self.cached_batches and not self.streamed_batches else 0
        return max(0, self.cached - overlap) + self.cache_transient

    @property
    def peak(self) -> int:
        """Estimated peak beyond the model itself: the snapshot, and the larger of a
        product (kept caches, one streamed batch, one sub-block's tangents and arrays)
        and the computation of a batch's cache (:attr:`computing_cache`)."""
        product = self.cached + self.streaming_batch + self.products
        return self.snapshot + max(product, self.computing_cache)

    def __str__(self) -> str:
        if not self.measured:
            return (
                f"memory plan (before the first pass): budget {format_bytes(self.budget)}, "
                f"snapshot {format_bytes(self.snapshot)}; batch caches and sub-block size "
                "are measured on the first pass"
            )
        total = self.cached_batches + self.streamed_batches
        return (
            f"memory plan: budget {format_bytes(self.budget)}, estimated peak "
            f"{format_bytes(self.peak)}\n"
            f"  snapshot {format_bytes(self.snapshot)}\n"
            f"  cache {format_bytes(self.cache_per_batch)} per batch: cached "
            f"{self.cached_batches} of {total} batches ({format_bytes(self.cached)}), "
            f"streaming {self.streamed_batches}"
            + (
                f"; computing one: {format_bytes(self.cache_transient)} (measured)\n"
                if self.cache_transient
                else "\n"
            )
            + f"  products: sub-blocks of {self.block_size} ({format_bytes(self.products)}: "
            f"{format_bytes(self.per_vector)} of tangents per vector in flight"
            f"{' (measured)' if self.per_vector_measured else ' (estimated)'}, "
            f"{'one vector' if self.parallel == 1 else f'up to {self.parallel} vectors'} "
            f"in flight, {format_bytes(self.per_row)} per row of the (k, n) arrays)"
        ) + self._over_budget()

    def _over_budget(self) -> str:
        """A line saying by how much the estimate exceeds the budget (empty if it fits)."""
        if self.peak <= self.budget:
            return ""
        return (
            f"\n  over the budget by {format_bytes(self.peak - self.budget)}: lower batch_size "
            "(smaller batch caches and tangents), cache fewer batches (cache_bytes) or raise "
            "memory_budget"
        )


@dataclass(frozen=True)
class KFACMemoryPlan:
    """What a K-FAC or EKFAC operator holds, in bytes (``KFACOperator.memory_plan``).

    ``factors``: the float64 factors on the host (A and G per layer, EKFAC's scalings,
    the other variables' diagonal); ``eigendecompositions``: their eigenvectors and
    eigenvalues, made on first need (spectrum, inverse, EKFAC products;
    ``eigendecompositions_made`` says whether they exist yet); ``product_copies``: the
    factors in the operator's dtype where the products run (TensorFlow; NumPy in float32;
    0 for NumPy in float64; an inverse in TensorFlow makes its own); ``per_vector``: what one
    vector of a product adds (its input, output and their transposes, and the widest
    layer's intermediates); ``block_size``: the vectors planned for; ``device``: where
    the products run ("TensorFlow" or "NumPy").
    """

    factors: int
    eigendecompositions: int
    eigendecompositions_made: bool
    product_copies: int
    block_size: int
    per_vector: int
    device: str

    @property
    def products(self) -> int:
        """Bytes a product of ``block_size`` vectors adds while it runs."""
        return self.block_size * self.per_vector

    @property
    def peak(self) -> int:
        """The factors, their eigendecompositions, the product copies and one product."""
        return self.factors + self.eigendecompositions + self.product_copies + self.products

    def __str__(self) -> str:
        made = "made" if self.eigendecompositions_made else "made on first need"
        return (
            f"K-FAC memory plan: estimated peak {format_bytes(self.peak)}\n"
            f"  factors {format_bytes(self.factors)} (float64, host)\n"
            f"  eigendecompositions {format_bytes(self.eigendecompositions)} ({made})\n"
            f"  products in {self.device}: factor copies {format_bytes(self.product_copies)}, "
            f"{format_bytes(self.per_vector)} per vector, {format_bytes(self.products)} for "
            f"{self.block_size} vector{'s' if self.block_size != 1 else ''}"
        )
