"""contiguous_shards: the split of a list over workers that rollouts, environment steps and generation share."""

from nemo_like.utils.sharding import contiguous_shards


def test_pieces_are_contiguous_ceil_sized_and_never_empty():
    assert contiguous_shards(list(range(5)), 3) == [[0, 1], [2, 3], [4]]
    assert contiguous_shards(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]
    assert contiguous_shards(list(range(7)), 2) == [[0, 1, 2, 3], [4, 5, 6]]
    assert contiguous_shards([0, 1], 4) == [[0], [1]]  # fewer items than workers: the last workers get none
    assert contiguous_shards(list(range(4)), 3) == [[0, 1], [2, 3]]  # ceil size: 2 pieces, not 3
    assert contiguous_shards([], 3) == []


def test_keeps_the_sequence_type_and_gives_rank_r_its_ceil_sized_slice():
    prompts = [[i] for i in range(10)]
    for n in range(1, 13):
        per = -(-len(prompts) // n)  # rank r takes prompts[r*per:(r+1)*per] if non-empty
        slices = [piece for piece in (prompts[r * per : (r + 1) * per] for r in range(n)) if piece]
        assert contiguous_shards(prompts, n) == slices
    assert contiguous_shards("abcde", 2) == ["abc", "de"]
