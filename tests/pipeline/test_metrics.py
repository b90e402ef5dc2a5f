"""Metrics: expected values are worked out by hand or by another route, not the same formula."""

import math

import pytest
import torch

from numbisect.pipeline.metrics import (
    RLThresholds,
    activation_error,
    activation_error_multi,
    aggregate,
    full_kl,
    rl_cost,
    routing_agreement,
    token_metrics,
    ulp_stats,
    worst_tokens,
)

LN2 = math.log(2.0)


# --- per-token estimators ---------------------------------------------------


def test_token_metrics_known_values():
    # log_r = 0, log 2, -log 2 (reference 0.5 vs engine 0.5, 0.25, 1.0)
    ref = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    eng = torch.log(torch.tensor([0.5, 0.25, 1.0]))
    m = token_metrics(ref, eng)
    assert m["k3"].dtype == torch.float64
    assert m["log_r"].tolist() == pytest.approx([0.0, LN2, -LN2], abs=1e-7)
    assert m["k1"].tolist() == pytest.approx([0.0, -LN2, LN2], abs=1e-7)
    assert m["k2"].tolist() == pytest.approx([0.0, LN2 * LN2 / 2, LN2 * LN2 / 2], abs=1e-7)
    # r = 2: 2 - 1 - ln 2;  r = 1/2: 1/2 - 1 + ln 2
    assert m["k3"].tolist() == pytest.approx([0.0, 1 - LN2, LN2 - 0.5], abs=1e-7)
    assert m["ratio"].tolist() == pytest.approx([1.0, 2.0, 0.5], abs=1e-6)


def test_k3_accurate_for_tiny_log_ratios():
    # k3 ~ log_r**2 / 2 for small log_r; exp(x) - 1 - x in float64 would lose it.
    log_r = torch.tensor([1e-10, -1e-9], dtype=torch.float64)
    k3 = token_metrics(log_r, torch.zeros_like(log_r))["k3"]
    assert k3.tolist() == pytest.approx([5e-21, 5e-19], rel=1e-4)


def test_k3_nonnegative():
    g = torch.Generator().manual_seed(0)
    ref = -torch.rand(10_000, generator=g) * 5
    eng = -torch.rand(10_000, generator=g) * 5
    assert bool((token_metrics(ref, eng)["k3"] >= 0).all())


def test_k1_and_k3_estimate_kl_under_engine_sampling():
    q = [0.5, 0.2, 0.15, 0.1, 0.05]  # engine
    p = [0.3, 0.3, 0.2, 0.1, 0.1]  # reference
    kl = sum(qi * math.log(qi / pi) for qi, pi in zip(q, p))
    g = torch.Generator().manual_seed(1234)
    tokens = torch.multinomial(torch.tensor(q), 200_000, replacement=True, generator=g)
    logp_eng = torch.log(torch.tensor(q))[tokens]
    logp_ref = torch.log(torch.tensor(p))[tokens]
    m = token_metrics(logp_ref, logp_eng)
    assert m["k1"].mean().item() == pytest.approx(kl, rel=0.05)
    assert m["k3"].mean().item() == pytest.approx(kl, rel=0.05)


def test_token_metrics_shape_mismatch():
    with pytest.raises(ValueError):
        token_metrics(torch.zeros(3), torch.zeros(4))


# --- exact KL -------------------------------------------------------------------


def test_full_kl_hand_example():
    q = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    p = torch.log(torch.tensor([[0.25, 0.75]], dtype=torch.float64))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    out = full_kl(q, p)
    assert out.dtype == torch.float64
    assert out.shape == (1,)
    assert out.item() == pytest.approx(expected, rel=1e-12)


def test_full_kl_zero_for_identical_distributions():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    lp = torch.log_softmax(logits, dim=-1)
    assert full_kl(lp, lp).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_full_kl_handles_neg_inf():
    ninf = -math.inf
    # engine puts all its mass on token 0: KL = 1 * log(1 / 0.5)
    q = torch.tensor([[0.0, ninf, ninf]])
    p = torch.tensor([[math.log(0.5), math.log(0.5), ninf]])
    assert full_kl(q, p).item() == pytest.approx(LN2)
    # engine has mass where the reference has none: infinite KL
    q2 = torch.tensor([[math.log(0.5), math.log(0.5), ninf]])
    p2 = torch.tensor([[0.0, ninf, ninf]])
    assert full_kl(q2, p2).item() == math.inf


def test_full_kl_grows_while_top1_agrees():
    q = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    p = torch.log(torch.tensor([[0.4, 0.35, 0.25]]))
    assert q.argmax() == p.argmax()
    assert full_kl(q, p).item() > 0.05


# --- aggregates -------------------------------------------------------------------


def test_aggregate_known_array():
    a = aggregate(torch.arange(1, 101, dtype=torch.float32))
    assert a["count"] == 100
    assert a["mean"] == pytest.approx(50.5)
    assert a["p50"] == pytest.approx(50.5)
    assert a["p99"] == pytest.approx(1 + 0.99 * 99)  # linear interpolation
    assert a["max"] == 100.0
    assert all(isinstance(v, (int, float)) for v in a.values())


def test_aggregate_matches_torch_quantile():
    v = torch.rand(1001, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    a = aggregate(v)
    assert a["p50"] == pytest.approx(torch.quantile(v, 0.5).item(), abs=1e-15)
    assert a["p99"] == pytest.approx(torch.quantile(v, 0.99).item(), abs=1e-15)


def test_aggregate_single_and_empty():
    assert aggregate(torch.tensor([2.5])) == {
        "count": 1, "mean": 2.5, "p50": 2.5, "p99": 2.5, "max": 2.5
    }
    assert aggregate(torch.tensor([])) == {
        "count": 0, "mean": None, "p50": None, "p99": None, "max": None
    }


def test_worst_tokens_sorted_with_ties():
    values = torch.tensor([0.1, 0.9, 0.5, 0.9, 0.0])
    index = [(0, 1, 11), (1, 4, 12), (0, 2, 13), (0, 7, 14), (2, 1, 15)]
    out = worst_tokens(values, index, k=3)
    assert [(w["sample"], w["position"], w["token_id"]) for w in out] == [
        (0, 7, 14), (1, 4, 12), (0, 2, 13)
    ]
    assert out[0]["value"] == pytest.approx(0.9)
    assert len(worst_tokens(values, index, k=10)) == 5
    assert worst_tokens(torch.tensor([]), [], k=3) == []


def test_worst_tokens_nan_first_and_length_check():
    out = worst_tokens(torch.tensor([1.0, math.nan]), [(0, 1, 5), (0, 2, 6)], k=1)
    assert out[0]["position"] == 2
    with pytest.raises(ValueError):
        worst_tokens(torch.tensor([1.0]), [(0, 1, 5), (0, 2, 6)])


# --- RL cost ------------------------------------------------------------------------


def test_rl_cost_constructed_case():
    ln3, ln6 = math.log(3.0), math.log(6.0)
    seqs = [
        torch.tensor([0.0, 0.0, 0.0]),  # A: clean
        torch.tensor([ln3, -ln3]),  # B: ratio 3 (TIS) and 1/3 (IcePop); geo 1; k3 ~0.67
        torch.tensor([0.002] * 4),  # C: geo 1.002 only
        torch.tensor([ln6]),  # D: ratio 6: every rule
        torch.tensor([]),  # E: no judged tokens, skipped
        torch.tensor([0.15, -0.15]),  # F: geo 1, mean k3 0.0113 only
    ]
    out = rl_cost(seqs, RLThresholds())
    assert out["tokens"] == 12
    assert out["sequences"] == 5
    assert out["token_frac_tis"] == pytest.approx(2 / 12)  # B[0], D[0]
    assert out["token_frac_icepop"] == pytest.approx(2 / 12)  # B[1], D[0]
    assert out["seq_frac_tis"] == pytest.approx(2 / 5)  # B, D
    assert out["seq_frac_icepop"] == pytest.approx(2 / 5)  # B, D
    assert out["seq_frac_geo"] == pytest.approx(2 / 5)  # C, D
    assert out["seq_frac_k3"] == pytest.approx(3 / 5)  # B, D, F
    assert out["seq_frac_rejected"] == pytest.approx(4 / 5)  # all but A
    assert out["thresholds"] == {
        "tis_cap": 2.0, "icepop_low": 0.5, "icepop_high": 5.0,
        "geo_low": 0.999, "geo_high": 1.001, "seq_k3_max": 0.01,
    }


def test_rl_cost_thresholds_are_configurable():
    th = RLThresholds(tis_cap=10.0, icepop_high=10.0, geo_high=10.0, seq_k3_max=10.0)
    out = rl_cost([torch.tensor([math.log(6.0)])], th)
    assert out["seq_frac_tis"] == 0.0
    assert out["seq_frac_icepop"] == 0.0
    assert out["seq_frac_rejected"] == 0.0
    assert out["thresholds"]["tis_cap"] == 10.0


def test_rl_cost_nothing_to_count():
    out = rl_cost([torch.tensor([])], RLThresholds())
    assert out["tokens"] == 0 and out["sequences"] == 0
    assert out["seq_frac_rejected"] is None and out["token_frac_tis"] is None


# --- activation error ------------------------------------------------------------------


def test_activation_error_identical():
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    out = activation_error(x, x.clone())
    assert out["max_abs"] == 0.0
    assert out["mean_abs"] == 0.0
    assert out["rel_l2"] == 0.0
    assert out["cosine"] == pytest.approx(1.0)
    assert out["sqnr_db"] == math.inf
    assert out["token_rel_max"] == 0.0


def test_activation_error_scaled():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = activation_error(x, 1.1 * x)
    assert out["rel_l2"] == pytest.approx(0.1)
    assert out["cosine"] == pytest.approx(1.0)
    assert out["sqnr_db"] == pytest.approx(20.0)  # signal 1, noise 0.1 in amplitude
    assert out["token_rel_max"] == pytest.approx(0.1)
    assert out["max_abs"] == pytest.approx(0.1 * x.abs().max().item())


def test_activation_error_one_bad_token_not_averaged_away():
    ref = torch.ones(100, 8)
    eng = ref.clone()
    eng[37] += 0.5
    out = activation_error(ref, eng)
    # whole tensor: sqrt(8 * 0.25) / sqrt(800) = 0.05; token 37 alone: 0.5
    assert out["rel_l2"] == pytest.approx(0.05)
    assert out["token_rel_max"] == pytest.approx(0.5)
    assert out["worst_token"] == 37
    assert out["max_abs"] == pytest.approx(0.5)
    assert out["mean_abs"] == pytest.approx(0.5 / 100)


def test_activation_error_zero_reference():
    z = torch.zeros(3, 4)
    both = activation_error(z, z)
    assert both["rel_l2"] == 0.0 and both["cosine"] == 1.0 and both["sqnr_db"] == math.inf
    eng = z.clone()
    eng[1, 2] = 0.25
    only_eng = activation_error(z, eng)
    assert only_eng["rel_l2"] == math.inf
    assert only_eng["cosine"] == 0.0
    assert only_eng["token_rel_max"] == pytest.approx(0.25)  # zero row: absolute error
    assert only_eng["worst_token"] == 1


def test_activation_error_shape_mismatch():
    with pytest.raises(ValueError):
        activation_error(torch.zeros(3, 4), torch.zeros(4, 3))


def test_activation_error_multi_locates_sample_and_token():
    refs = [torch.ones(3, 4), torch.ones(5, 4)]
    engs = [r.clone() for r in refs]
    engs[1][2] *= 2.0
    out = activation_error_multi(refs, engs)
    assert out["worst_token"] == {"sample": 1, "token": 2}
    assert out["token_rel_max"] == pytest.approx(1.0)
    # 4 elements off by 1 among 32 ones: ||d|| = 2, ||r|| = sqrt(32)
    assert out["rel_l2"] == pytest.approx(2 / math.sqrt(32))
    with pytest.raises(ValueError):
        activation_error_multi([torch.ones(2, 4)], [torch.ones(3, 4)])


# --- bitwise equality and ulps ---------------------------------------------------


def test_ulp_bf16_neighbours_are_one_ulp():
    x = torch.tensor([1.0, -3.5, 1e-3, 200.0], dtype=torch.bfloat16)
    y = torch.nextafter(x, torch.full_like(x, math.inf))
    out = ulp_stats(x, y, torch.bfloat16)
    assert out == {"bitwise_equal": False, "frac_differ": 1.0, "max_ulps": 1, "max_ulps_all": 1}


def test_ulp_bf16_one_to_two_is_128_ulps():
    # bfloat16 has 7 explicit mantissa bits: 128 representable values in [1, 2)
    out = ulp_stats(torch.tensor([1.0]), torch.tensor([2.0]), torch.bfloat16)
    assert out["max_ulps"] == 128


def test_ulp_across_zero_excluded_by_floor():
    ref = torch.tensor([1.0, 1e-5])
    eng = torch.tensor([1.0, -1e-5])
    out = ulp_stats(ref, eng, torch.bfloat16)
    assert out["bitwise_equal"] is False
    assert out["frac_differ"] == 0.5
    assert out["max_ulps_all"] > 20_000  # tens of thousands of bf16 ulps apart
    assert out["max_ulps"] == 0
    assert ulp_stats(ref, eng, torch.bfloat16, floor=0.0)["max_ulps"] > 20_000


def test_ulp_identical_and_signed_zero():
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    assert ulp_stats(x, x.clone(), torch.bfloat16) == {
        "bitwise_equal": True, "frac_differ": 0.0, "max_ulps": 0, "max_ulps_all": 0
    }
    zeros = ulp_stats(torch.tensor([0.0]), torch.tensor([-0.0]), torch.float32)
    assert zeros["bitwise_equal"] is False
    assert zeros["max_ulps_all"] == 0


def test_ulp_casts_to_engine_dtype_first():
    ref = torch.tensor([1.0], dtype=torch.float32)
    eng = ref + 1e-5  # differs in float32, rounds to the same bfloat16
    assert ulp_stats(ref, eng, torch.bfloat16)["bitwise_equal"] is True
    f32 = ulp_stats(ref, torch.nextafter(ref, torch.tensor([2.0])), torch.float32)
    assert f32["max_ulps"] == 1
    f16 = ulp_stats(torch.tensor([1.0]), torch.tensor([1.0 + 2**-10]), torch.float16)
    assert f16["max_ulps"] == 1


def test_ulp_nan():
    out = ulp_stats(torch.tensor([1.0, math.nan]), torch.tensor([1.0, math.nan]), torch.bfloat16)
    assert out["bitwise_equal"] is False
    assert out["frac_differ"] == 0.5
    assert out["max_ulps"] is None and out["max_ulps_all"] is None


def test_ulp_rejects_other_dtypes():
    with pytest.raises(ValueError):
        ulp_stats(torch.zeros(2), torch.zeros(2), torch.int8)


# --- routing ------------------------------------------------------------------


def test_routing_agreement_one_flipped_row():
    ref = torch.tensor([[0, 1], [2, 3], [4, 5]])
    eng = torch.tensor([[1, 0], [2, 4], [4, 5]])  # row 0 reordered only
    assert routing_agreement(ref, eng) == {"tokens": 3, "agree_frac": 2 / 3, "flipped": [1]}


def test_routing_agreement_shape_mismatch():
    with pytest.raises(ValueError):
        routing_agreement(torch.zeros(3, 2), torch.zeros(3, 4))


# --- NaN and overflow: never a value that drops out or compares as small ----------------------


def test_full_kl_row_with_a_nan_on_either_side_is_inf():
    """A NaN engine log-prob used to drop out of the sum (q > 0 is False for NaN): KL 0."""
    p = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25], [0.5, 0.25, 0.25]]))
    q = p.clone()
    q[0, 1] = math.nan  # engine row 0
    p2 = p.clone()
    p2[1, 2] = math.nan  # reference row 1
    assert full_kl(q, p).tolist() == [math.inf, 0.0, 0.0]
    assert full_kl(p, p2).tolist() == [0.0, math.inf, 0.0]
    assert full_kl(torch.full((1, 3), math.nan), p[:1]).tolist() == [math.inf]


def test_aggregate_counts_a_nan_as_inf():
    a = aggregate(torch.tensor([0.0, 0.0, math.nan, 0.0]))
    assert a["count"] == 4 and a["mean"] == math.inf and a["max"] == math.inf and a["p99"] == math.inf
    assert a["p50"] == 0.0


def test_k3_of_an_infinite_log_ratio_is_inf_not_nan():
    t = token_metrics(torch.tensor([0.0, -math.inf, -1.0]), torch.tensor([-math.inf, 0.0, -1.0]))
    assert t["k3"].tolist() == [math.inf, math.inf, 0.0]


def test_rl_cost_rejects_nan_and_saturates_huge_log_ratios():
    """A rollout log-prob of -1000 (allowed by the trace format) made log_r ~ 1000 and
    math.exp of the sequence mean raised OverflowError; it is a rejected sequence."""
    for lr in ([1000.0, 999.0], [-1000.0], [0.0, math.nan, 0.0], [math.inf], [math.inf, -math.inf]):
        out = rl_cost([torch.tensor(lr, dtype=torch.float64)], RLThresholds())
        assert out["seq_frac_rejected"] == 1.0, lr
        assert out["seq_frac_geo"] == 1.0 and out["seq_frac_k3"] == 1.0, (lr, out)
        assert out["token_frac_icepop"] > 0, lr
    clean = rl_cost([torch.tensor([0.0, 0.0])], RLThresholds())
    assert clean["seq_frac_rejected"] == 0.0


def test_activation_error_with_a_nan_is_the_worst_in_every_measure():
    ref = torch.ones(4, 8)
    eng = ref.clone()
    eng[2, 3] = math.nan
    for a, b in ((ref, eng), (eng, ref)):
        out = activation_error(a, b)
        assert out["max_abs"] == out["mean_abs"] == out["rel_l2"] == out["token_rel_max"] == math.inf, out
        assert out["cosine"] == -1.0 and out["sqnr_db"] == -math.inf
        assert out["worst_token"] == 2
    inf_eng = ref.clone()
    inf_eng[1, 0] = math.inf  # inf/inf cosine: worst, not NaN
    out = activation_error(ref, inf_eng)
    assert out["rel_l2"] == math.inf and out["cosine"] == -1.0
