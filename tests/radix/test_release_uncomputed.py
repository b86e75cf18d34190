"""KVCacheManager.release_uncomputed, speculative decoding's rollback: the blocks past the computed tokens go back
to the free queue (with and without prefix caching), only computed full blocks are cached, invariants hold."""

from __future__ import annotations

import pytest

from radix.manager import KVCacheManager
from tests.radix.radix_testing import admit, toks


@pytest.mark.parametrize("caching", [True, False])
def test_release_uncomputed_frees_the_draft_blocks(caching):
    m = KVCacheManager(11, block_size=4, enable_prefix_caching=caching)
    admit(m, 1, toks(1, 6))
    m.commit_computed(1, 6)
    m.append_tokens(1, [50])  # 7 known tokens, 6 computed
    assert m.allocate(1, 1 + 6) == [3, 4]  # the last token and a 6-token draft: positions 6..12
    free = m.num_free_blocks()
    m.append_tokens(1, [51, 52])  # two draft tokens accepted, then a third token drawn
    m.commit_computed(1, 9)
    assert m.release_uncomputed(1) == [4]  # block 4 held only rejected slots (12); block 3 holds computed 8
    assert m.block_table(1) == [1, 2, 3]
    assert m.num_free_blocks() == free + 1
    assert m.release_uncomputed(1) == []  # nothing past cdiv(9, 4) = 3 blocks
    assert m.stats().cached_blocks == (2 if caching else 0)  # [1..4] [5, 6, 50, 51]: computed and full
    m.check_invariants()
    m.free(1)
    assert m.num_free_blocks() + m.num_evictable_blocks() == 10
    m.check_invariants()
