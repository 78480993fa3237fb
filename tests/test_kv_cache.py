"""The KV cache: allocated once, written by position, compacted, truncated and shared in place."""

import pytest
import torch

from specsot_mq.kv_cache import KVCache, KVCacheOverflow


def cache(slots=3, capacity=10):
    return KVCache(num_layers=2, num_slots=slots, num_kv_heads=2, capacity=capacity, head_dim=4)


def entries(n, start=0.0):
    """[1, heads=2, n, dim=4] with distinct values per position."""
    base = torch.arange(n, dtype=torch.float32)[None, None, :, None] + start
    return base.expand(1, 2, n, 4).clone()


def test_write_appends_at_each_slots_length():
    c = cache()
    storage = c.k.data_ptr()
    assert c.reserve([1], 3) == [0]
    for layer in range(2):
        c.write(layer, [1], [0], entries(3), -entries(3))
    assert c.reserve([1], 2) == [3]
    c.write(0, [1], [3], entries(2, 100), entries(2, 100))
    k, v = c.view(0, [1], 5)
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 100, 101]
    assert v[0, 1, :3, 0].tolist() == [0, -1, -2]
    assert c.lengths == [0, 5, 0] and c.k.data_ptr() == storage


def test_write_rows_at_different_starts_and_non_consecutive_slots():
    c = cache(slots=4)
    c.lengths = [2, 0, 5, 0]
    starts = c.reserve([2, 0], 2)
    assert starts == [5, 2]
    k = torch.cat([entries(2, 10), entries(2, 20)])
    c.write(1, [2, 0], starts, k, k)
    assert c.k[1, 2, 0, 5:7, 0].tolist() == [10, 11]
    assert c.k[1, 0, 1, 2:4, 0].tolist() == [20, 21]
    gathered, _ = c.view(1, [2, 0], 7)
    assert gathered.shape == (2, 2, 7, 4) and gathered[1, 0, 2:4, 0].tolist() == [20, 21]


def test_move_compacts_an_accepted_path_in_all_layers():
    c = cache()
    c.reserve([0], 8)
    for layer in range(2):
        c.write(layer, [0], [0], entries(8), entries(8, 50))
    c.move(0, [5, 7], dst=4)  # keep tree nodes 5 and 7 right after the accepted prefix
    assert c.lengths[0] == 6
    for layer in range(2):
        assert c.k[layer, 0, 0, :6, 0].tolist() == [0, 1, 2, 3, 5, 7]
        assert c.v[layer, 0, 1, :6, 0].tolist() == [50, 51, 52, 53, 55, 57]


def test_move_with_overlapping_ranges_is_safe():
    c = cache()
    c.reserve([0], 6)
    c.write(0, [0], [0], entries(6), entries(6))
    c.move(0, [2, 3, 4], dst=3)  # source and destination overlap
    assert c.k[0, 0, 0, :6, 0].tolist() == [0, 1, 2, 2, 3, 4]


def test_truncate_keeps_memory_and_later_writes_overwrite():
    c = cache()
    c.reserve([0], 5)
    c.write(0, [0], [0], entries(5), entries(5))
    c.truncate(0, 2)
    assert c.lengths[0] == 2
    assert c.reserve([0], 1) == [2]
    c.write(0, [0], [2], entries(1, 99), entries(1, 99))
    assert c.k[0, 0, 0, :4, 0].tolist() == [0, 1, 99, 3]
    with pytest.raises(ValueError):
        c.truncate(0, 7)


def test_copy_prefix_shares_a_prompt_with_other_slots():
    c = cache()
    c.reserve([0], 4)
    for layer in range(2):
        c.write(layer, [0], [0], entries(4, 1), entries(4, 2))
    c.copy_prefix(0, [1, 2], length=3)
    assert c.lengths == [4, 3, 3]
    assert torch.equal(c.k[:, 1, :, :3], c.k[:, 0, :, :3])
    assert torch.equal(c.v[:, 2, :, :3], c.v[:, 0, :, :3])
    with pytest.raises(ValueError):
        c.copy_prefix(1, [2], length=4)


def test_slots_holding_a_copied_prefix_read_it_from_one_of_them_until_it_is_cut():
    """copy_prefix names what it copied; a forward over those slots may read that prefix from the
    first of them (prefix_sources), until a slot's entries below its end may change (truncate,
    move, restore, reset)."""
    c = cache(slots=5)
    c.reserve([0], 4)
    assert c.prefix_sources([0, 1]) is None  # nothing shared
    c.copy_prefix(0, [1], length=3)
    c.copy_prefix(0, [2], length=3)  # one slot at a time: still one prefix
    assert c.prefix_sources([1, 0, 2]) == ([1, 1, 1], [0, 3, 3])
    assert c.prefix_sources([3, 2]) is None  # 2 is the only one of them here
    c.copy_prefix(0, [3], length=2)  # another length: another prefix, with slot 0 now
    assert c.prefix_sources([1, 2, 3, 0]) == ([1, 1, 3, 3], [0, 3, 0, 2])
    c.reserve([1, 2], 2)
    c.truncate(1, 3)  # not below the prefix: still shared
    c.move(2, [4], 3)
    assert c.prefix_sources([1, 2]) == ([1, 1], [0, 3])
    c.truncate(1, 2)
    assert c.prefix_sources([1, 2]) is None
    c.move(3, [0], 1)
    assert c.prefix_sources([0, 3]) is None
    c.copy_prefix(2, [4], length=3)
    c.restore(4, c.snapshot(2, 3))
    assert c.prefix_sources([2, 4]) is None
    c.copy_prefix(2, [4], length=3)
    c.reset(2)
    assert c.prefix_sources([2, 4]) is None


def test_overflow_raises_a_clear_error_and_changes_nothing():
    c = cache(capacity=10)
    c.reserve([0, 1], 8)
    with pytest.raises(KVCacheOverflow, match=r"slot 1 holds 8 of 10 positions and 3 more do not fit"):
        c.reserve([2, 1], 3)
    assert c.lengths == [8, 8, 0]
    with pytest.raises(KVCacheOverflow):
        c.move(0, [0, 1, 2], dst=8)


def test_a_slot_named_again_claims_its_positions_after_its_previous_claim():
    """A ragged forward (layout.py) runs a sequence's tokens as rows of their own: each claim of
    the same slot starts where the one before it ended, and an overflow counts them all."""
    c = cache(capacity=10)
    c.reserve([0], 4)
    assert c.reserve([0, 1, 0, 0, 1], 1) == [4, 0, 5, 6, 1]
    assert c.lengths[:2] == [7, 2]
    with pytest.raises(KVCacheOverflow, match=r"slot 0 holds 7 of 10 positions and 4 more do not fit"):
        c.reserve([0, 1, 0, 0, 0], 1)
    assert c.lengths[:2] == [7, 2]
