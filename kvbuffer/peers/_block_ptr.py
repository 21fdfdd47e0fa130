"""Block pointers for the Triton interpreter (``TRITON_INTERPRET=1`` only; compiled code never sees this).

Triton 3.9 removed ``tl.make_block_ptr`` / ``tl.advance`` (they raise ``NotImplementedError``) and the
``boundary_check`` / ``padding_option`` arguments of ``tl.load`` / ``tl.store``; fla's kernel copies in SGLang
still use them.  Here they are again, as element pointers and masks handed to the ordinary ``tl.load`` /
``tl.store``, with the semantics block pointers had:

* ``make_block_ptr(base, shape, strides, offsets, block_shape, order)``: block [block_shape] of a tensor
  [shape] at ``base`` with ``strides`` (in elements), its first element at index ``offsets``; element
  ``(j_0, ..)`` of the block is at ``base + sum_i (offsets_i + j_i) * strides_i``.  ``order`` (the memory
  layout hint) changes no value;
* ``advance(ptr, deltas)``: the same block moved by ``deltas`` (offsets_i + deltas_i);
* ``load(ptr, boundary_check=dims, padding_option=...)``: the block; an element whose index along a dim in
  ``boundary_check`` is outside ``[0, shape_i)`` is not read and reads as 0 (NaN for ``padding_option="nan"``);
  dims not in ``boundary_check`` are not checked;
* ``store(ptr, value, boundary_check=dims)``: writes the block, skipping elements outside along those dims.

``language`` is the namespace a kernel's ``tl`` becomes (``_sources.interpretable_chunk_kernels``): these four,
and every other name read from ``triton.language`` when used (so the interpreter's patches of it apply).
``load`` and ``store`` of an ordinary pointer are ``triton.language``'s own.
"""

from __future__ import annotations

import triton.language as tl

__all__ = ["BlockPointer", "make_block_ptr", "advance", "load", "store", "language"]


def _value(x):
    """``x`` without its ``tl.constexpr`` wrapper."""
    return x.value if isinstance(x, tl.constexpr) else x


class BlockPointer:
    """A block [block_shape] of a tensor [shape] (``make_block_ptr``'s arguments, constexprs unwrapped).
    ``dtype`` is the base pointer's type, so ``ptr.dtype.element_ty`` is the element dtype as in kernels."""

    def __init__(self, base, shape, strides, offsets, block_shape, order):
        self.base, self.order = base, order
        self.shape, self.strides, self.offsets = (tuple(_value(x) for x in xs) for xs in (shape, strides, offsets))
        self.block_shape = tuple(int(_value(b)) for b in block_shape)
        if not len(self.shape) == len(self.strides) == len(self.offsets) == len(self.block_shape):
            raise ValueError("make_block_ptr: shape, strides, offsets and block_shape differ in length")

    @property
    def dtype(self):
        return self.base.dtype

    def advance(self, offsets):
        return advance(self, offsets)


def make_block_ptr(base, shape, strides, offsets, block_shape, order):
    """``tl.make_block_ptr``: a BlockPointer (``base``: a scalar pointer; the rest: one entry per dim)."""
    return BlockPointer(base, shape, strides, offsets, block_shape, order)


def advance(ptr: BlockPointer, offsets):
    """``tl.advance``: ``ptr`` with ``offsets`` (one per dim) added to its offsets."""
    moved = tuple(o + _value(d) for o, d in zip(ptr.offsets, offsets))
    return BlockPointer(ptr.base, ptr.shape, ptr.strides, moved, ptr.block_shape, ptr.order)


def _elements(ptr: BlockPointer, boundary_check) -> tuple:
    """(element pointers [block_shape], mask or None) of ``ptr``: along dim i the indices ``offsets_i +
    arange(block_shape_i)`` (int64), shaped [1, .., block_shape_i, .., 1]; the mask ANDs ``0 <= index <
    shape_i`` over the dims in ``boundary_check`` (broadcast to the block by tl.load / tl.store)."""
    checked = {int(_value(d)) for d in boundary_check}
    n = len(ptr.block_shape)
    pointers, mask = ptr.base, None
    for d, size in enumerate(ptr.block_shape):
        index = tl.arange(0, size).to(tl.int64) + ptr.offsets[d]
        index = tl.reshape(index, [size if i == d else 1 for i in range(n)])
        pointers = pointers + index * ptr.strides[d]
        if d in checked:
            inside = (index >= 0) & (index < ptr.shape[d])
            mask = inside if mask is None else mask & inside
    return pointers, mask


def load(pointer, mask=None, other=None, boundary_check=(), padding_option="", **kwargs):
    """``tl.load``: a BlockPointer's block (out-of-bounds elements 0, or NaN for ``padding_option="nan"``);
    any other pointer to ``triton.language.load``."""
    if not isinstance(pointer, BlockPointer):
        if boundary_check or padding_option:
            raise ValueError("boundary_check and padding_option are for block pointers only")
        return tl.load(pointer, mask, other, **kwargs)
    if mask is not None or other is not None:
        raise ValueError("mask and other cannot be given with a block pointer")
    if padding_option not in ("", "zero", "nan"):
        raise ValueError(f"padding_option {padding_option!r}: '', 'zero' or 'nan'")
    pointers, inside = _elements(pointer, boundary_check)
    if inside is None:
        return tl.load(pointers, **kwargs)
    return tl.load(pointers, inside, float("nan") if padding_option == "nan" else 0, **kwargs)


def store(pointer, value, mask=None, boundary_check=(), **kwargs):
    """``tl.store``: ``value`` into a BlockPointer's block (out-of-bounds elements skipped); any other
    pointer to ``triton.language.store``."""
    if not isinstance(pointer, BlockPointer):
        if boundary_check:
            raise ValueError("boundary_check is for block pointers only")
        return tl.store(pointer, value, mask, **kwargs)
    if mask is not None:
        raise ValueError("mask cannot be given with a block pointer")
    pointers, inside = _elements(pointer, boundary_check)
    return tl.store(pointers, value, inside, **kwargs)


class _Language:
    """``triton.language`` with the block pointers above: every other name is read from the module when used."""

    make_block_ptr = staticmethod(make_block_ptr)
    advance = staticmethod(advance)
    load = staticmethod(load)
    store = staticmethod(store)

    def __getattr__(self, name):
        return getattr(tl, name)


#: What a kernel's ``tl`` becomes under the interpreter (``_sources.interpretable_chunk_kernels``).
language = _Language()
