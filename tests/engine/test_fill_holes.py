"""``fill_holes``: the row moves both KV stores use to drop rows keep every other row, once, and copy one
row per hole at most."""

from hypothesis import given
from hypothesis import strategies as st

from agentrl.engine.model_runner import fill_holes


@given(st.integers(0, 40).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, max(n - 1, 0)), max_size=n))))
def test_moves_keep_every_other_row_once(case):
    n, drop = case
    drop = sorted(d for d in drop if d < n)
    moves, order = fill_holes(n, drop)
    rows = list(range(n))
    for src, dst in moves:
        rows[dst] = rows[src]
    kept = len(order)
    assert rows[:kept] == order
    assert sorted(order) == [r for r in range(n) if r not in drop]
    assert len(moves) <= len(drop)
    assert all(dst < kept <= src for src, dst in moves)
