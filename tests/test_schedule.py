import json

import pytest
from omegaconf import OmegaConf

from specee.config import PlacementConfig
from specee.early_exit.schedule import (PROFILE, AllLayers, TwoLevelSchedule, build_schedule,
                                        default_window, offline_set)
from specee.errors import SpeceeError


def active_layers(s, state):
    return [i for i, a in enumerate(s.active(state)) if a]


def test_paper_worked_example():
    """Last exits [16, 19, 20, 19, 20] with w=1 -> online set {15..21}."""
    s = TwoLevelSchedule(32, None, online=True, n=5, w=1)
    st = s.new_request()
    for x in [16, 19, 20, 19, 20]:
        s.record(st, x)
    assert s.online_set(st) == list(range(15, 22))
    assert active_layers(s, st) == list(range(15, 22))
    assert st.counts[19] == 4 and st.counts[15] == 1 and st.counts[21] == 2


def test_queue_forgets_the_oldest_exit():
    s = TwoLevelSchedule(32, None, online=True, n=3, w=1)
    st = s.new_request()
    for x in [5, 10, 10, 20]:  # 5 leaves the queue when 20 arrives
        s.record(st, x)
    assert list(st.queue) == [10, 10, 20]
    assert s.online_set(st) == [9, 10, 11, 19, 20, 21]
    assert sum(st.counts) == 9


def test_windows_clip_at_the_stack_edges():
    s = TwoLevelSchedule(8, None, online=True, n=2, w=2)
    st = s.new_request()
    s.record(st, 0)
    s.record(st, 7)
    assert s.online_set(st) == [0, 1, 2, 5, 6, 7]


def test_warm_up_runs_all_layers_until_n_exits():
    s = TwoLevelSchedule(10, [3], online=True, n=3, w=1)
    st = s.new_request()
    assert active_layers(s, st) == list(range(10))
    s.record(st, 6); s.record(st, 6)
    assert active_layers(s, st) == list(range(10))
    s.record(st, 6)
    assert active_layers(s, st) == [3, 5, 6, 7]  # offline {3} ∪ online {5, 6, 7}


def test_state_resets_per_request_but_not_in_the_reference_variant():
    s = TwoLevelSchedule(12, None, online=True, n=2, w=2)
    a = s.new_request()
    s.record(a, 4); s.record(a, 4)
    b = s.new_request()
    assert list(b.queue) == [] and sum(b.counts) == 0
    ref = TwoLevelSchedule(12, None, online=True, n=2, w=2, reference_variant=True)
    a = ref.new_request()
    ref.record(a, 4); ref.record(a, 4)
    b = ref.new_request()
    assert list(b.queue) == [4, 4]
    assert ref.online_set(b) == [2, 4, 6]  # offsets {-w, 0, +w} only


def test_offline_only_uses_the_profile_set():
    s = TwoLevelSchedule(6, [1, 4], online=False, n=5, w=1)
    st = s.new_request()
    s.record(st, 2)
    assert active_layers(s, st) == [1, 4]


def test_offline_top_m_and_coverage_rule():
    counts = [0, 5, 40, 30, 20, 5]
    assert offline_set(counts, 2, 0.8) == [2, 3]
    assert offline_set(counts, None, 0.8) == [2, 3, 4]  # 40+30 = 70 % < 80 %, +20 = 90 %
    assert offline_set(counts, None, 1.0) == [1, 2, 3, 4, 5]


def test_default_window_scales_with_depth():
    assert default_window(32) == 2 and default_window(24) == 2 and default_window(12) == 1
    assert default_window(80) == 5


def test_profile_round_trip_and_errors(tmp_path):
    counts = [0, 1, 9, 3, 0, 12]
    (tmp_path / PROFILE).write_text(json.dumps({"exit_counts": counts}))
    cfg = OmegaConf.structured(PlacementConfig(name="offline_topm", offline=True, m=2))
    s = build_schedule(cfg, 6, tmp_path)
    assert active_layers(s, s.new_request()) == [2, 3]  # the last layer (no exit) is not a candidate
    with pytest.raises(SpeceeError, match="profile_exits"):
        build_schedule(cfg, 6, tmp_path / "absent")
    with pytest.raises(SpeceeError, match="layers"):
        build_schedule(cfg, 8, tmp_path)
    (tmp_path / PROFILE).write_text("{broken")
    with pytest.raises(SpeceeError, match="corrupt"):
        build_schedule(cfg, 6, tmp_path)
    assert isinstance(build_schedule(OmegaConf.structured(PlacementConfig(name="all_layers")), 6, None),
                      AllLayers)


def test_hit_rate_against_hand_counts():
    from specee.bench.exit_stats import distribution, hit_rate, shuffled_hit_rate
    seqs = [[3, 3, 4, 9, 3]]
    # n=1, w=1: t=1 (3 vs {2,3,4}) hit, t=2 (4 vs {2,3,4}) hit, t=3 (9 vs {3,4,5}) miss,
    # t=4 (3 vs {8,9,10}) miss -> 2/4; coverage 3/12 each time.
    rate, cover, count = hit_rate(seqs, 1, 1, 12)
    assert (rate, count) == (0.5, 4) and cover == pytest.approx(3 / 12)
    # n=2: t=2 (4 in {2..4}) hit, t=3 (9 in {2..5}) miss, t=4 (3 in {3..5, 8..10}) hit.
    assert hit_rate(seqs, 2, 1, 12)[0] == pytest.approx(2 / 3)
    const = [[5] * 30]
    assert hit_rate(const, 3, 0, 12)[0] == 1.0 and shuffled_hit_rate(const, 3, 0, 12) == 1.0
    d = distribution([0, 0, 1, 11], 12)
    assert d["share_of_exits_in_shallower_half_by_depth"] == 0.75 and d["share_without_exit"] == 0.25
    assert d["share_of_layers_below_uniform"] == pytest.approx(9 / 12)
    assert d["skew_bottom_half_by_probability"] == 0.0  # the 6 least-used layers have no exits


def test_paper_skew_statistic_ranks_layers_by_exit_probability_not_depth():
    from specee.bench.exit_stats import distribution
    # Shares 0.4, 0.3, 0.2, 0.1 by depth: the shallower half holds 0.7, but the two layers with
    # the fewest exits (layers 2 and 3) hold 0.3 -- the paper's statistic.
    d = distribution([0] * 4 + [1] * 3 + [2] * 2 + [3], 4)
    assert d["skew_bottom_half_by_probability"] == pytest.approx(0.3)
    assert d["share_of_exits_in_shallower_half_by_depth"] == pytest.approx(0.7)
    uniform = distribution([0, 1, 2, 3] * 5, 4)
    assert uniform["skew_bottom_half_by_probability"] == pytest.approx(0.5)


def test_offline_rule_is_the_papers_m_unless_told_otherwise():
    from specee.early_exit.schedule import offline_rule
    p = lambda **kw: OmegaConf.structured(PlacementConfig(name="online_union", offline=True, online=True, **kw))  # noqa: E731
    assert offline_rule(p(), 32)[0] == 8  # the paper's 8 of 32, unscaled on a 32-layer model
    assert offline_rule(p(), 24)[0] == 6 and offline_rule(p(), 80)[0] == 20
    assert offline_rule(p(m=3), 32)[0] == 3
    m, coverage, why = offline_rule(p(coverage=0.8), 32)
    assert m is None and coverage == 0.8 and "80%" in why
