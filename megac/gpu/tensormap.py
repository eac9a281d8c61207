"""The KV pools' tensor maps (``LaunchDesc::kv_tmaps``, ABI 7).

The megakernel's attention splits copy a 16-key chunk of one kv head as
boxes of 16 tokens x 1 head x 64 dims through the tensor-memory unit
(over the pool's dims in memory order: token-major or head-major pools)
(``opcodes/attn_mma.cuh``, tensor-copy form). A box is described by a
``CUtensorMap`` (128 bytes, 64-byte aligned) that only the driver can
encode (``cuTensorMapEncodeTiled``); this module encodes the K and the V
pool's maps into one 256-byte device buffer. Where the pools' shape does not
allow the boxes (a block size that is not a multiple of 16 tokens, a head
size that is not 64 or 128), there is no buffer and the descriptor's pointer
is null: the splits then copy in 16-byte pieces, as before.
"""

from __future__ import annotations

import ctypes

from megac.errors import MegacError

#: tokens per box (the splits' chunk: one k step of P V on the tensor cores)
BOX_TOKENS = 16
#: head dims per box: 64 bf16 = 128 bytes, the 128-byte swizzle's row
BOX_DIMS = 64
#: bytes of one encoded map
TMAP_BYTES = 128

# CUtensorMapDataType / Interleave / Swizzle / L2promotion / FloatOOBfill
_BF16, _NO_INTERLEAVE, _SWIZZLE_128B, _L2_256B, _NO_OOB_FILL = 9, 0, 3, 3, 0


def boxes_fit(block_size: int, head_dim: int) -> bool:
    """Whether the splits' boxes tile these pools: a box never crosses a
    KV block (16 tokens at a multiple of 16) and the head is one or two
    64-dim halves (the device form's shapes)."""
    return block_size % BOX_TOKENS == 0 and head_dim in (64, 128)


def head_major(pool) -> bool:
    """Whether ``pool`` (seen as ``[num_blocks, block_size, kv_heads,
    head_dim]``) is a view of head-major storage (megac.kv.paged)."""
    nb, bs, kvh, hd = (int(x) for x in pool.shape)
    # block_size > 1 tells the layouts apart even for one KV head (its stride is the storage's)
    return tuple(int(x) for x in pool.stride()) == (kvh * bs * hd, hd, bs * hd, 1) and bs > 1


def pool_strides(pool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dims innermost first, byte strides of dims 1..3) of a bf16 pool
    seen as ``[num_blocks, block_size, kv_heads, head_dim]``, in the order
    its memory holds them: token-major (head dims, kv heads, tokens of a
    block, blocks), or head-major, a view of ``[num_blocks, kv_heads,
    block_size, head_dim]`` (head dims, tokens, kv heads, blocks: the order
    opcodes/attn_mma.cuh gives its box coordinates where the model's
    KV_HEAD_MAJOR is 1). Any other strides: a one-line MegacError."""
    nb, bs, kvh, hd = (int(x) for x in pool.shape)
    st = tuple(int(x) for x in pool.stride())
    if head_major(pool):
        return (hd, bs, kvh, nb), (hd * 2, bs * hd * 2, kvh * bs * hd * 2)
    if st == (bs * kvh * hd, kvh * hd, hd, 1):
        return (hd, kvh, bs, nb), (hd * 2, kvh * hd * 2, bs * kvh * hd * 2)
    raise MegacError(f"KV tensor maps: a pool of shape {list(pool.shape)} with strides {list(st)} is neither "
                     f"token-major nor head-major")


def encode_pool(pool, box_tokens: int = BOX_TOKENS) -> bytes:
    """The ``CUtensorMap`` of one bf16 pool ``[num_blocks, block_size,
    kv_heads, head_dim]`` on the GPU: box 64 dims x 1 head x ``box_tokens``
    tokens x 1 block, 128-byte swizzle (the layout ``attn::swz`` reads)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise MegacError(f"KV tensor maps: the CUDA driver library is not loadable ({e})") from None
    dims, strides = pool_strides(pool)
    # 64 dims x 1 head x box_tokens tokens x 1 block, in the dims' memory order
    box = (BOX_DIMS, int(box_tokens), 1, 1) if head_major(pool) else (BOX_DIMS, 1, int(box_tokens), 1)
    raw = (ctypes.c_uint8 * (TMAP_BYTES + 64))()
    base = (ctypes.addressof(raw) + 63) // 64 * 64  # the map must be 64-byte aligned
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = lib.cuTensorMapEncodeTiled(
        ctypes.c_void_p(base), _BF16, 4, ctypes.c_void_p(pool.data_ptr()), (u64 * 4)(*dims), (u64 * 3)(*strides),
        (u32 * 4)(*box), (u32 * 4)(1, 1, 1, 1), _NO_INTERLEAVE, _SWIZZLE_128B, _L2_256B, _NO_OOB_FILL)
    if rc != 0:
        raise MegacError(f"KV tensor maps: cuTensorMapEncodeTiled failed (CUresult {rc}) for a pool of shape "
                         f"{list(pool.shape)}")
    return bytes((ctypes.c_uint8 * TMAP_BYTES).from_address(base))


def kv_tmaps(k_pool, v_pool):
    """A 256-byte uint8 tensor on the pools' device holding the K map then
    the V map, or None where :func:`boxes_fit` says no (the descriptor's
    ``kv_tmaps`` is then null)."""
    import torch  # noqa: PLC0415

    if tuple(k_pool.shape) != tuple(v_pool.shape) or k_pool.stride() != v_pool.stride():
        raise MegacError(f"KV tensor maps: K pool {list(k_pool.shape)} and V pool {list(v_pool.shape)} differ")
    _, bs, _, hd = (int(x) for x in k_pool.shape)
    if k_pool.dtype != torch.bfloat16 or not boxes_fit(bs, hd):
        return None
    blob = encode_pool(k_pool) + encode_pool(v_pool)
    # torch's allocations are 256-byte aligned: both maps stay on 64-byte boundaries
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(k_pool.device)
