"""Random projections: the linear checksum of a reduction (docs/contracts.md, "The float bound").

``r_k . x`` for two random vectors ``r_k``, the same on every rank (fixed
seeds): a reduction's output ``y = f * sum_i x_i`` must satisfy
``r_k . y = f * sum_i r_k . x_i`` (up to rounding for floats; exactly, modulo
2^bits, for integers). Each rank projects only its own data, so checking the
identity costs one pass per rank and a few numbers on the wire.
"""

from __future__ import annotations

import operator
import random
from array import array
from dataclasses import dataclass
from typing import Any

import torch

from .hashing import memory_at, tensor_memory

BLOCK = 4096  # projection block: float32 accumulation over at most this many elements
# Blocks per chunk of a fused pass: 1 MiB of float32, still in the core's cache
# when the projection reads it after the hash; also the scratch bound of a
# conversion from half or integer types.
CHUNK_ROWS = 64
# A replicated output's share of at most this many blocks (2 MiB of float32)
# is hashed whole and then projected in one product: hash and product both
# find it in cache (L2 + L3 here), and a chunk loop's torch calls cost more
# than the chunks save. Larger shares go chunk by chunk.
FUSED_ROWS = 2 * CHUNK_ROWS
SEED = 0x5EED_C0DE
_MAX_CACHED_VIEWS = 256  # (columns, tail) views by address and range: a model's buckets, with room
# Reads by address and range, one per variant: a model's buckets x 2 (input, share), with room.
_MAX_CACHED_READS = 256
PROJECTIONS = 2  # independent random projections, computed in the same pass
# Independent pairs of vectors; call seq uses pair seq % VARIANTS (the same on
# every rank), so a corruption that recurs call after call meets fresh vectors.
VARIANTS = 16
_VARIANT_STRIDE = 1_000_003


def variant_of(step: int, bucket: int) -> int:
    """Which of the ``VARIANTS`` pairs of vectors a call uses, from its record's
    optimizer step and bucket (its index among the step's calls of its kind),
    the same on every rank.

    A call that recurs at the same bucket of every step (a DDP bucket) meets a
    new pair each step, all of them in ``VARIANTS`` consecutive steps whatever
    the number of buckets per step; the calls of one kind in one step use
    distinct pairs (up to ``VARIANTS`` of them: 5 is odd). Before the first step (no steps
    yet) the bucket counts every call, so a call recurring every k calls meets
    ``VARIANTS / gcd(k, VARIANTS)`` pairs. (The pair used to be ``seq mod
    VARIANTS``: a bucket then met ``VARIANTS / gcd(calls per step, VARIANTS)``
    of them, 4 for two buckets and two other jobs per step.)
    """
    return (step + 5 * bucket) % VARIANTS


def tensor_weight(j: int) -> tuple[float, int]:
    """The weight (float, int) of the j-th tensor of a list: lists are projected as
    ``sum_j w_j r.x_j``, so two same-sized tensors that trade places change it.
    1 for the first (a single tensor is projected as itself)."""
    if j == 0:
        return 1.0, 1
    rng = random.Random(SEED + j)
    sign = rng.choice((-1, 1))
    return sign * (0.5 + rng.random()), sign * rng.randrange(1, 1 << 20)


@dataclass(frozen=True, slots=True)
class _Read:
    """Everything ``Projection.floats`` needs to read one tensor of its work dtype at one
    address, block range and variant: the strided view of the blocks, the partial
    last block, the byte view for a hasher, the vectors, the block weights and
    the buffer the results are written to (and views of it to read them by).
    Owns no tensor memory of the input (the views are over a byte view of the
    address, as in ``Projection._views_of``); it holds the results' buffer ``out``."""

    cols: torch.Tensor | None  # (BLOCK x blocks) view, or None when no whole block is read
    rest: torch.Tensor | None  # the partial last block, when it is in the range
    memory: memoryview  # every byte of the tensor (a hasher reads it whole)
    r: torch.Tensor  # the variant's base vectors in the work dtype
    tail_r: torch.Tensor | None  # r[:, :tail]
    tail_weights: tuple[float, ...]  # per projection: the weight of the partial last block
    blocks: int
    # Flat, in the work dtype, when ``cols`` is not None: the products land in its
    # first PROJECTIONS x blocks (as a contiguous matrix), the tail's products in
    # the next PROJECTIONS, the norm last (shared by the variants). Each result
    # is a contiguous tensor, as a fresh one is: a strided result would take
    # other kernels (other bits).
    out: torch.Tensor | None
    products: torch.Tensor | None  # out's (PROJECTIONS x blocks) matrix
    tail_out: torch.Tensor | None  # out's PROJECTIONS tail products
    norm_out: torch.Tensor | None  # out's last element
    # Read back with no torch call: ``values`` is out's memory as Python's
    # float32 (or float64) items; ``rows[k]``, projection k's products in it,
    # and ``row_weights[k]``, its block weights [b0, b0 + blocks) (float64,
    # contiguous), are zipped in the weighted sums.
    values: memoryview[float] | None
    rows: tuple[memoryview[float], ...]
    row_weights: tuple[memoryview[float], ...]


class Projection:
    """Two random vectors r_k, the same on every rank (fixed seeds), applied blockwise;
    ``VARIANTS`` independent such pairs, chosen per call.

    r_k[j] = base[k, j mod 4096] * weight[k, j // 4096]: one matrix product
    over the (blocks x 4096) view of the data (both projections in one pass),
    then a float64 dot with the block weights. Distinct weights per block make
    aligned block swaps visible; two projections make a miss (a corruption
    whose projection happens to be tiny) the product of two small chances.
    """

    def __init__(self, seed: int = SEED) -> None:
        self._seed = seed
        self._bases: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._weight_lists: dict[tuple[int, int], list[list[float]]] = {}
        self._weight_arrays: dict[tuple[int, int], tuple[array[float], ...]] = {}
        self._tails: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._views: dict[tuple[Any, ...], tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self._reads: dict[tuple[Any, ...], tuple[_Read, ...]] = {}  # one read per variant
        self.r64, self.r32, self.rint = self.base(0)

    # The vectors of every variant are made at the first need of one (the base)
    # or of one size (the block weights): a step of a DDP job uses a new variant
    # per bucket until all ``VARIANTS`` have come round, so making them one at a
    # time spread ~5 ms of generators over a run's first 16 steps (measured
    # inside the job), where making them together is one cost at the first step.
    # The same seeds, so the same vectors.

    def base(self, variant: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The 4096-entry vectors (float64, float32, int64) of one of the ``VARIANTS``."""
        got = self._bases.get(variant)
        if got is None:
            for v in (variant, *range(VARIANTS)):
                if v not in self._bases:
                    self._bases[v] = self._make_base(v)
            got = self._bases[variant]
        return got

    def _make_base(self, variant: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self._seed + _VARIANT_STRIDE * variant)
        base = torch.randn(PROJECTIONS, BLOCK, generator=g, dtype=torch.float64)
        base[base == 0] = 1.0
        rint = torch.randint(1, 1 << 20, (PROJECTIONS, BLOCK), generator=g, dtype=torch.int64) * (
            torch.randint(0, 2, (PROJECTIONS, BLOCK), generator=g, dtype=torch.int64) * 2 - 1
        )
        return base, base.float(), rint

    def weights(self, blocks: int, variant: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Block weights (float64, int64) for >= ``blocks`` blocks: a function of the size
        (and the variant) only."""
        cap = 1 << max(blocks - 1, 0).bit_length()
        w = self._weights.get((variant, cap))
        if w is None:
            for v in (variant, *range(VARIANTS)):
                if (v, cap) not in self._weights:
                    self._weights[(v, cap)] = self._make_weights(cap, v)
            w = self._weights[(variant, cap)]
        return w

    def _make_weights(self, cap: int, variant: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self._seed + cap + _VARIANT_STRIDE * variant)
        wf = torch.randn(PROJECTIONS, cap, generator=g, dtype=torch.float64)
        wf[wf == 0] = 1.0
        wi = torch.randint(1, 1 << 20, (PROJECTIONS, cap), generator=g, dtype=torch.int64)
        return wf, wi

    def weights_list(self, blocks: int, variant: int = 0) -> list[list[float]]:
        """The float block weights as Python lists (cached with the tensors)."""
        cap = 1 << max(blocks - 1, 0).bit_length()
        got = self._weight_lists.get((variant, cap))
        if got is None:
            for v in (variant, *range(VARIANTS)):
                if (v, cap) not in self._weight_lists:
                    self._weight_lists[(v, cap)] = self.weights(blocks, v)[0].tolist()
            got = self._weight_lists[(variant, cap)]
        return got

    def weights_array(self, blocks: int, variant: int = 0) -> tuple[array[float], ...]:
        """``weights_list`` as float64 arrays, one per projection (the same values):
        a kept read zips its products with slices of them, so a step touches 8
        contiguous bytes per weight rather than a list of float objects."""
        cap = 1 << max(blocks - 1, 0).bit_length()
        got = self._weight_arrays.get((variant, cap))
        if got is None:
            lists = self.weights_list(blocks, variant)
            got = self._weight_arrays[(variant, cap)] = tuple(array("d", w) for w in lists)
        return got

    def floats(
        self,
        x: torch.Tensor,
        *,
        wide: bool = False,
        norm: bool = True,
        part: tuple[int, int] = (0, 1),
        variant: int = 0,
        hasher: Any = None,
    ) -> tuple[list[float], float]:
        """([r_k . x], ||x||_2) of a flat float tensor; non-finite if x is (or overflows).

        ``part = (i, parts)``: the projections over the i-th of ``parts`` block
        ranges only (summed over i they give the whole; ``parts = 0``: none);
        the norm is always of the whole tensor, and 0 unless ``norm``. ``variant``:
        which of the ``VARIANTS`` pairs of vectors. ``hasher``: also feed every
        byte of ``x`` to it, in order (``x`` contiguous on the CPU).

        A replicated output is hashed and projected in one read: a share of
        at most ``FUSED_ROWS`` blocks is hashed whole, then projected from
        cache; a larger one ``CHUNK_ROWS`` blocks at a time, each hashed right
        before it is projected. (The input's norm is a pass of its own: fused
        the same way, measured slower here, its extra torch calls costing more
        than the second read of a gradient bucket.)
        """
        n = x.numel()
        work = torch.float64 if wide or x.dtype == torch.float64 else torch.float32
        if x.dtype == work and n and part[1] and 0 <= variant < VARIANTS:
            # The common call (a DDP bucket or its share, every step): one cached
            # read, the same products and sums as below in the same order.
            key = (x.data_ptr(), n, work, part)
            reads = self._reads.get(key)
            if reads is None:
                reads = self._reads_of(x, n, work, part, key)
            read = reads[variant]
            if hasher is None or read.blocks <= FUSED_ROWS:
                return read_floats(read, x, work, norm, hasher)
        b0, f1, tail, with_tail = block_range(n, part)
        full = n // BLOCK
        w = self.weights_list(full + (1 if tail else 0), variant)
        r64, r32, _ = self.base(variant)
        r = r64 if work == torch.float64 else r32
        blocks = f1 - b0
        sums = [0.0] * PROJECTIONS
        # Few torch calls: for the small tensors of many calls their overhead,
        # not the arithmetic, is the cost (a call costs tens of us in a loaded
        # job thread). So one product over a strided view of the blocks when
        # they fit the cache or nothing rides along, and the block weights
        # applied in Python floats (one tolist instead of a conversion, a
        # slice and a dot).
        cols = rest = None
        if x.dtype == work and (blocks > 0 or with_tail):
            cols, rest = self._views_of(x, n, b0, blocks, with_tail)
        if hasher is not None and (x.dtype != work or blocks > FUSED_ROWS):
            per_block = hashed_chunks(x, r, b0, f1, work, hasher)
        else:
            if hasher is not None:  # a share that fits the cache: hash all, then project it
                hasher.update(tensor_memory(x))
            if blocks <= 0:
                per_block = None
            elif cols is not None:
                per_block = torch.mm(r, cols).tolist()
            else:
                per_block = converted_chunks(x, r, b0, f1, work)
        if per_block is not None:
            sums = [sum(map(operator.mul, per_block[k], w[k][b0:f1])) for k in range(PROJECTIONS)]
        if with_tail:  # the last, partial block: its weight applied in Python floats
            if rest is None:
                rest = x[full * BLOCK :]
            if rest.dtype != work:
                rest = rest.to(work)
            last = torch.mv(self._tail_vectors(r, variant, tail), rest).tolist()
            sums = [sums[k] + last[k] * w[k][full] for k in range(PROJECTIONS)]
        size = float(torch.linalg.vector_norm(x, dtype=work)) if n and norm else 0.0
        return sums, size

    def _reads_of(
        self, x: torch.Tensor, n: int, work: torch.dtype, part: tuple[int, int], key: Any
    ) -> tuple[_Read, ...]:
        """Make and keep the reads of ``x`` (contiguous, of the work dtype) at ``key``,
        one per variant: all at its first call, as the vectors are made."""
        b0, f1, tail, with_tail = block_range(n, part)
        full = n // BLOCK
        blocks = f1 - b0
        cols, rest = self._views_of(x, n, b0, blocks, with_tail)
        memory = tensor_memory(x)
        out = products = tail_out = norm_out = values = None
        if cols is not None:
            end = PROJECTIONS * blocks
            out = torch.empty(end + PROJECTIONS + 1, dtype=work)
            products = out[:end].view(PROJECTIONS, blocks)
            tail_out, norm_out = out[end : end + PROJECTIONS], out[end + PROJECTIONS]
            values = memory_at(out.data_ptr(), out.nbytes).cast(
                "d" if work == torch.float64 else "f"
            )
        rows = (
            tuple(values[k * blocks : (k + 1) * blocks] for k in range(PROJECTIONS))
            if values is not None
            else ()
        )
        reads = []
        for variant in range(VARIANTS):
            w = self.weights_list(full + (1 if tail else 0), variant)
            wa = self.weights_array(full + (1 if tail else 0), variant)
            r64, r32, _ = self.base(variant)
            r = r64 if work == torch.float64 else r32
            reads.append(
                _Read(
                    cols=cols,
                    rest=rest,
                    memory=memory,
                    r=r,
                    tail_r=self._tail_vectors(r, variant, tail) if with_tail else None,
                    tail_weights=tuple(w[k][full] for k in range(PROJECTIONS)) if with_tail else (),
                    blocks=blocks,
                    out=out,
                    products=products,
                    tail_out=tail_out,
                    norm_out=norm_out,
                    values=values,
                    rows=rows,
                    row_weights=tuple(
                        memoryview(a).cast("B").cast("d")[b0 : b0 + blocks] for a in wa
                    ),
                )
            )
        if len(self._reads) >= _MAX_CACHED_READS:
            self._reads.clear()
        got = self._reads[key] = tuple(reads)
        return got

    def _views_of(
        self, x: torch.Tensor, n: int, b0: int, blocks: int, with_tail: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The (BLOCK x blocks) view of blocks [b0, b0 + blocks) of the flat contiguous
        CPU tensor ``x`` (column j = block b0 + j) and its partial last block, if any.

        Cached by address, size, dtype and range (with whether the range reads the
        partial last block: two ranges may start at the same block and read as
        many whole ones): a DDP bucket is the same memory every step, and two
        view constructions per call cost tens of us in a loaded job thread
        (measured). The views are built over a byte view of the
        address that does not own the memory (``tensor_memory``), so the cache
        keeps nothing alive; they are used only for an ``x`` that lies at that
        address now (the caller holds it), so they read exactly its bytes.
        """
        key = (x.data_ptr(), n, x.dtype, b0, blocks, with_tail)
        got = self._views.get(key)
        if got is None:
            flat = torch.frombuffer(tensor_memory(x), dtype=x.dtype)
            cols = flat.as_strided((BLOCK, blocks), (1, BLOCK), b0 * BLOCK) if blocks > 0 else None
            rest = flat[n // BLOCK * BLOCK :] if with_tail else None
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            got = self._views[key] = (cols, rest)
        return got

    def _tail_vectors(self, r: torch.Tensor, variant: int, tail: int) -> torch.Tensor:
        """``r[:, :tail]`` (cached: a bucket's tail is the same every step)."""
        key = (variant, tail, r.dtype)
        got = self._tails.get(key)
        if got is None:
            got = self._tails[key] = r[:, :tail]
        return got

    def ints(
        self, x: torch.Tensor, *, part: tuple[int, int] = (0, 1), variant: int = 0
    ) -> list[int]:
        """[r_k . x] over int64 with wrap-around (exact modulo 2^64); ``part``, ``variant``
        as in floats."""
        n = x.numel()
        b0, f1, tail, with_tail = block_range(n, part)
        _, wi = self.weights(n // BLOCK + (1 if tail else 0), variant)
        rint = self.base(variant)[2]
        s = torch.zeros(PROJECTIONS, dtype=torch.int64)
        if f1 > b0:
            rows = x[b0 * BLOCK : f1 * BLOCK].view(f1 - b0, BLOCK)
            v = torch.empty(PROJECTIONS, f1 - b0, dtype=torch.int64)
            for a in range(0, f1 - b0, CHUNK_ROWS):
                b = min(a + CHUNK_ROWS, f1 - b0)
                torch.mm(rint, rows[a:b].to(torch.int64).t(), out=v[:, a:b])
            s += (v * wi[:, b0:f1]).sum(1)
        if with_tail:
            full = n // BLOCK
            s += torch.mv(rint[:, :tail], x[full * BLOCK :].to(torch.int64)) * wi[:, full]
        return [int(v) for v in s.tolist()]


def block_range(n: int, part: tuple[int, int]) -> tuple[int, int, int, bool]:
    """Blocks [b0, f1) of a ``part = (i, parts)`` split of ``n`` elements, and the tail."""
    full, tail = divmod(n, BLOCK)
    blocks = full + (1 if tail else 0)
    i, parts = part
    if parts == 0:  # no blocks at all (the norm only)
        return 0, 0, tail, False
    b0, b1 = blocks * i // parts, blocks * (i + 1) // parts
    return b0, min(b1, full), tail, bool(tail) and b0 <= full < b1


def read_floats(
    read: _Read, x: torch.Tensor, work: torch.dtype, norm: bool, hasher: Any
) -> tuple[list[float], float]:
    """``floats`` over a kept read (its share fits the cache when a hasher rides along).

    The product, the tail's product and the norm are written into the read's
    buffer and read back through a memoryview of it, with no torch call: each
    torch call costs 10-30 us in a job thread right after a backward pass
    (cold caches; 1-3 us warm), and a ``tolist`` of the buffer also made a
    list of fresh float objects that the weighted sums then walked, cold
    (inside the DDP job, measured: a first ``tolist`` 19 us against 10 for a
    second one, the sums over its list 21 us per call). The same kernels on the same
    operands, and the same products and weights multiplied and summed in the
    same order, so the same values as separate results (records bit-identical).
    """
    if hasher is not None:
        hasher.update(read.memory)
    out, cols, values = read.out, read.cols, read.values
    rest, tail_r = read.rest, read.tail_r
    tail = rest is not None and tail_r is not None
    if out is None or cols is None or values is None:  # no whole block: the tail and norm alone
        sums = [0.0] * PROJECTIONS
        if rest is not None and tail_r is not None:
            last = torch.mv(tail_r, rest).tolist()
            sums = [sums[k] + last[k] * read.tail_weights[k] for k in range(PROJECTIONS)]
        return sums, float(torch.linalg.vector_norm(x, dtype=work)) if norm else 0.0
    if norm:
        # The norm first: it streams the bucket in from memory (its first read
        # after the backward pass wrote it), and the product, which computes
        # more per byte, then finds it in cache. Measured inside the DDP job
        # (GPT, load average 2.4): 187 against 241 us for the 2.3 MiB bucket,
        # 107 against 120 for the 1 MiB one. The same results either way.
        torch.linalg.vector_norm(x, dtype=work, out=read.norm_out)
    torch.mm(read.r, cols, out=read.products)
    if rest is not None and tail_r is not None:
        torch.mv(tail_r, rest, out=read.tail_out)
    # Projection k: its products times the block weights [b0, b0 + blocks),
    # summed left to right (as ``sum`` over a list of them did).
    rows, weights = read.rows, read.row_weights
    sums = [sum(map(operator.mul, rows[k], weights[k])) for k in range(PROJECTIONS)]
    at = PROJECTIONS * read.blocks
    if tail:
        sums = [sums[k] + values[at + k] * read.tail_weights[k] for k in range(PROJECTIONS)]
    return sums, values[at + PROJECTIONS] if norm else 0.0


def hashed_chunks(
    x: torch.Tensor, r: torch.Tensor, b0: int, f1: int, work: torch.dtype, hasher: Any
) -> list[list[float]] | None:
    """Hash every byte of ``x`` in order and project blocks [b0, f1), ``CHUNK_ROWS``
    blocks at a time, each hashed right before it is projected (found in cache)."""
    memory = tensor_memory(x)
    unit = BLOCK * x.element_size()  # bytes per block
    hasher.update(memory[: b0 * unit])
    per_block = None
    if f1 > b0:
        rows = x[b0 * BLOCK : f1 * BLOCK].view(f1 - b0, BLOCK)
        v = torch.empty(PROJECTIONS, f1 - b0, dtype=work)
        for a in range(0, f1 - b0, CHUNK_ROWS):
            b = min(a + CHUNK_ROWS, f1 - b0)
            chunk = rows[a:b] if rows.dtype == work else rows[a:b].to(work)
            hasher.update(memory[(b0 + a) * unit : (b0 + b) * unit])
            torch.mm(r, chunk.t(), out=v[:, a:b])
        per_block = v.tolist()
    hasher.update(memory[f1 * unit :])
    return per_block


def converted_chunks(
    x: torch.Tensor, r: torch.Tensor, b0: int, f1: int, work: torch.dtype
) -> list[list[float]]:
    """Blocks [b0, f1) of a half or integer-typed ``x`` projected in ``work``,
    converted ``CHUNK_ROWS`` blocks at a time (bounded scratch)."""
    rows = x[b0 * BLOCK : f1 * BLOCK].view(f1 - b0, BLOCK)
    v = torch.empty(PROJECTIONS, f1 - b0, dtype=work)
    for a in range(0, f1 - b0, CHUNK_ROWS):
        b = min(a + CHUNK_ROWS, f1 - b0)
        torch.mm(r, rows[a:b].to(work).t(), out=v[:, a:b])
    out: list[list[float]] = v.tolist()
    return out
