import pytest

from peerflow.errors import ConfigError
from peerflow.layout import ParallelLayout


def test_tp_peers_are_adjacent_and_share_dp_rank():
    layout = ParallelLayout(dp=2, tp=2)
    assert [layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert layout.ranks_of_dp(1) == (2, 3)
    assert sorted(layout.groups("tp")) == [(0, 1), (2, 3)]
    assert sorted(layout.groups("dp")) == [(0, 2), (1, 3)]


def test_explicit_ranks_and_round_trip():
    layout = ParallelLayout(dp=2, pp=2, ranks=(4, 5, 6, 7))
    for rank in layout.global_ranks:
        coord = layout.coord(rank)
        assert layout.rank_at(dp=coord.dp, pp=coord.pp, tp=coord.tp) == rank
    assert layout.describe() == "pp2×dp2 @ ranks 4-7"


def test_bad_layouts_are_config_errors():
    with pytest.raises(ConfigError, match="must be at least 1"):
        ParallelLayout(tp=0)
    with pytest.raises(ConfigError, match="give exactly that many ranks"):
        ParallelLayout(dp=2, ranks=(0,))
    expected = r"tp=3 does not divide the model's 4 attention heads; choose tp from \[1, 2, 4\]"
    with pytest.raises(ConfigError, match=expected):
        ParallelLayout(tp=3).check_divides("attention heads", 4)
