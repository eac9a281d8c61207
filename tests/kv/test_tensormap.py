"""The KV pools' tensor maps (megac.gpu.tensormap) on the host side: which
pools the attention splits' boxes can tile, and the 4-D view the encoder
hands the driver (checked against torch's own strides of the pool)."""

import pytest
import torch

from megac import abi
from megac.errors import MegacError
from megac.gpu.tensormap import BOX_TOKENS, boxes_fit, head_major, kv_tmaps, pool_strides


@pytest.mark.parametrize("bs,hd,ok", [(16, 128, True), (64, 128, True), (64, 64, True), (32, 64, True),
                                      (8, 128, False), (64, 16, False), (64, 96, False), (64, 256, False)])
def test_boxes_fit_block_and_head_sizes(bs, hd, ok):
    assert boxes_fit(bs, hd) is ok


@pytest.mark.parametrize("shape", [(7, 64, 4, 128), (3, 16, 1, 64), (5, 32, 8, 64)])
def test_pool_view_matches_the_pools_layout(shape):
    pool = torch.empty(shape, dtype=torch.bfloat16)
    dims, strides = pool_strides(pool)
    assert dims == tuple(reversed(shape))
    # byte strides of (kv head, token, block) = torch's element strides x 2, innermost first
    assert strides == tuple(2 * s for s in reversed(pool.stride()[:3]))
    assert all(s % 16 == 0 for s in strides)  # the driver's rule for global strides


def test_no_maps_where_the_boxes_do_not_fit():
    # block of 8 tokens: a 16-token box would cross blocks; no driver call is made
    k = torch.zeros(4, 8, 2, 128, dtype=torch.bfloat16)
    assert kv_tmaps(k, k.clone()) is None
    k = torch.zeros(4, 64, 2, 16, dtype=torch.bfloat16)  # head of 16 dims: the cp.async form
    assert kv_tmaps(k, k.clone()) is None
    assert BOX_TOKENS == 16


def test_mismatched_pools_are_refused():
    with pytest.raises(MegacError, match="differ"):
        kv_tmaps(torch.zeros(4, 64, 2, 128, dtype=torch.bfloat16), torch.zeros(4, 64, 1, 128, dtype=torch.bfloat16))


def test_descriptor_carries_the_maps():
    doc = {f.name: f for f in abi.LAUNCH_DESC}["kv_tmaps"]
    assert doc.ctype == "ptr" and "null" in doc.doc


@pytest.mark.parametrize("shape", [(7, 64, 4, 128), (3, 16, 1, 64), (5, 32, 8, 64)])
def test_head_major_pool_maps_its_storage_in_memory_order(shape):
    """A head-major pool (storage [blocks, kv_heads, tokens, dims] seen as
    [blocks, tokens, kv_heads, dims]): the map's dims and byte strides are
    the storage's, innermost first (dims, tokens, kv heads, blocks), the
    order attn_mma.cuh gives its box coordinates under KV_HEAD_MAJOR."""
    nb, bs, kvh, hd = shape
    storage = torch.empty(nb, kvh, bs, hd, dtype=torch.bfloat16)
    view = storage.transpose(1, 2)
    assert tuple(view.shape) == shape and head_major(view) and not head_major(torch.empty(shape))
    dims, strides = pool_strides(view)
    assert dims == (hd, bs, kvh, nb)
    assert strides == tuple(2 * s for s in reversed(storage.stride()[:3]))


def test_pools_of_other_strides_are_refused_in_one_line():
    k = torch.zeros(4, 2, 64, 128, dtype=torch.bfloat16).permute(0, 2, 1, 3)  # head-major
    with pytest.raises(MegacError, match="differ"):  # one pool of each layout
        kv_tmaps(k, torch.zeros(4, 64, 2, 128, dtype=torch.bfloat16))
    odd = torch.zeros(64, 4, 2, 128, dtype=torch.bfloat16).transpose(0, 1)  # blocks not outermost
    with pytest.raises(MegacError, match="neither token-major nor head-major") as e:
        pool_strides(odd)
    assert "\n" not in str(e.value)
