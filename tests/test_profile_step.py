"""The profiled step decodes what the timed steps decode: one token per row,
not one token for every row (a random-weight MoE then routes every row to
the same experts and the trace shows a lighter step than the one timed)."""

from megac.gpu.profile import step_tokens


def test_every_row_of_a_profiled_step_decodes_its_own_token():
    rows = [3, 0, 7, 1, 5, 2, 6, 4]
    for i in range(12):
        toks = step_tokens(rows, i)
        assert len(toks) == len(rows)
        assert len(set(toks)) == len(rows), (i, toks)
        assert all(0 <= t < 1000 for t in toks)


def test_consecutive_steps_decode_different_tokens():
    rows = list(range(8))
    seen = [tuple(step_tokens(rows, i)) for i in range(6)]
    assert len(set(seen)) == len(seen)
    assert all(a[0] != b[0] for a, b in zip(seen, seen[1:]))
