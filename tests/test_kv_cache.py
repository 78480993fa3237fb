"""The KV cache (allocated once, written by position, compacted and shared in place) and its slot
manager (what each slot holds: the prefix it claims, where a forward may read it from, where a
prompt's computed beginning is, and how far a slot can grow)."""

import pytest
import torch

from specsot_mq.kv_cache import KVCache
from specsot_mq.prefix_store import Kept, PrefixStore
from specsot_mq.slots import KVCacheOverflow, SlotManager


def cache(slots=3, capacity=10):
    return KVCache(num_layers=2, num_slots=slots, num_kv_heads=2, capacity=capacity, head_dim=4)


def entries(n, start=0.0):
    """[1, heads=2, n, dim=4] with distinct values per position."""
    base = torch.arange(n, dtype=torch.float32)[None, None, :, None] + start
    return base.expand(1, 2, n, 4).clone()


def test_write_puts_entries_where_asked_in_the_one_buffer():
    c = cache()
    storage = c.k.data_ptr()
    for layer in range(2):
        c.write(layer, [1], [0], entries(3), -entries(3))
    c.write(0, [1], [3], entries(2, 100), entries(2, 100))
    k, v = c.view(0, [1], 5)
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 100, 101]
    assert v[0, 1, :3, 0].tolist() == [0, -1, -2]
    assert c.k.data_ptr() == storage and c.k[0, 0].abs().sum() == 0  # other slots untouched


def test_write_rows_at_different_starts_and_non_consecutive_slots():
    c = cache(slots=4)
    k = torch.cat([entries(2, 10), entries(2, 20)])
    c.write(1, [2, 0], [5, 2], k, k)
    assert c.k[1, 2, 0, 5:7, 0].tolist() == [10, 11]
    assert c.k[1, 0, 1, 2:4, 0].tolist() == [20, 21]
    gathered, _ = c.view(1, [2, 0], 7)
    assert gathered.shape == (2, 2, 7, 4) and gathered[1, 0, 2:4, 0].tolist() == [20, 21]


def test_move_compacts_an_accepted_path_in_all_layers():
    c = cache()
    for layer in range(2):
        c.write(layer, [0], [0], entries(8), entries(8, 50))
    c.move(0, [5, 7], dst=4)  # keep tree nodes 5 and 7 right after the accepted prefix
    for layer in range(2):
        assert c.k[layer, 0, 0, :6, 0].tolist() == [0, 1, 2, 3, 5, 7]
        assert c.v[layer, 0, 1, :6, 0].tolist() == [50, 51, 52, 53, 55, 57]


def test_move_with_overlapping_ranges_is_safe():
    c = cache()
    c.write(0, [0], [0], entries(6), entries(6))
    c.move(0, [2, 3, 4], dst=3)  # source and destination overlap
    assert c.k[0, 0, 0, :6, 0].tolist() == [0, 1, 2, 2, 3, 4]


def test_copy_shares_a_prompt_with_other_slots_and_a_snapshot_restores_it():
    c = cache()
    for layer in range(2):
        c.write(layer, [0], [0], entries(4, 1), entries(4, 2))
    c.copy(0, [1, 2, 0], length=3)
    assert torch.equal(c.k[:, 1, :, :3], c.k[:, 0, :, :3]) and torch.equal(c.v[:, 2, :, :3], c.v[:, 0, :, :3])
    assert c.k[0, 1, 0, 3, 0] == 0  # only the prefix
    kept = c.snapshot(0, 4)
    c.write(0, [0], [0], entries(4, 9), entries(4, 9))
    assert c.restore(0, kept) == 4 and c.k[0, 0, 0, :4, 0].tolist() == [1, 2, 3, 4]


def test_slots_of_one_copy_of_a_prefix_read_it_from_one_of_them():
    """Slots claiming the same copy of a prefix hold it bit for bit: a forward over them may read
    it from the first of them (prefix_sources); a slot that no longer holds it (claimed anew, or
    every claim forgotten) reads its own."""
    slots = SlotManager(cache(slots=5))
    assert slots.prefix_sources([0, 1]) is None  # nothing shared
    slots.claim([0, 1, 2], (7, 8, 9), copy=4)
    assert slots.prefix_sources([1, 0, 2]) == ([1, 1, 1], [0, 3, 3])
    assert slots.prefix_sources([3, 2]) is None  # 2 is the only one of them here
    slots.claim([3], (7, 8), copy=5)  # another prefix, with slot 0 now
    slots.claim([0], (7, 8), copy=5)
    assert slots.prefix_sources([1, 2, 3, 0]) == ([1, 1, 3, 3], [0, 3, 0, 2])
    slots.claim([1], (), copy=-1)  # 1 now holds another prompt
    assert slots.prefix_sources([1, 2]) is None
    slots.forget_claims()
    assert slots.prefix_sources([0, 3]) is None


def test_a_prompts_computed_beginning_is_found_in_a_slot_or_in_the_store():
    store = PrefixStore()
    slots = SlotManager(cache(slots=3), store=store)
    kv = (torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4))
    store.add([1, 2, 3], Kept(kv))  # no draft state
    assert slots.find([1, 2, 3, 4], [0, 1, 2], exact=False, with_draft=False).ids == [1, 2, 3]
    assert slots.find([1, 2, 3, 4], [0, 1, 2], exact=False, with_draft=True) is None
    slots.claim([1], (1, 2), copy=0)
    assert slots.find([1, 2, 3, 4], [0, 1, 2], exact=False, with_draft=True) is None  # a plain decoder's: no feature
    slots[1].feature = torch.zeros(4)  # the draft head's state at its end, as a decoder with the head leaves it
    assert slots.find([1, 2, 3, 4], [0, 1, 2], exact=False, with_draft=True) == 1  # shorter, but usable
    assert slots.find([1, 2, 3, 4], [0, 1, 2], exact=False, with_draft=False).ids == [1, 2, 3]  # the longest
    assert slots.find([1, 2], [0, 1, 2], exact=True, with_draft=False) == 1  # a slot first
    assert slots.find([1, 2], [0, 2], exact=True, with_draft=False) is None  # not one of the slots asked
    slots.claim([2], (1, 2, 3, 4), copy=1)
    assert slots.find([1, 2, 3], [0, 1, 2], exact=True, with_draft=False).ids == [1, 2, 3]  # 2 holds more


def test_overflow_is_a_clear_error():
    slots = SlotManager(cache(capacity=10))
    slots.check(1, 8, 2)  # fits exactly
    with pytest.raises(KVCacheOverflow, match=r"slot 1 holds 8 of 10 positions and 3 more do not fit"):
        slots.check(1, 8, 3)


def test_a_cache_beyond_what_the_machine_maps_is_one_error_naming_the_flag():
    """2^49 bytes: past the 47-bit address space of an x86-64 process, whatever the OS overcommits."""
    from specsot_mq.errors import SpecSotError

    with pytest.raises(SpecSotError, match=r"a KV cache for 1 sequences of \d+ positions takes .* GiB, .* lower --max-len"):
        KVCache(1, 1, 1, 2**46, 1, torch.float32)
