"""The in-the-loop trigger: threshold, cooldown, maximum fires; k3 as verl computes it."""

from __future__ import annotations

import math

import pytest
import torch

from numbisect.common.errors import InputError
from numbisect.live.trigger import Trigger, batch_k3


def test_batch_k3_is_the_mean_over_response_tokens():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.0, -2.5, -3.0], [-1.2, -1.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    log_r = torch.tensor([0.5, 0.0, 0.2, 0.0], dtype=torch.float64)
    want = float((log_r.exp() - 1 - log_r).mean())
    assert math.isclose(batch_k3(trainer, rollout, mask), want, rel_tol=1e-12)
    assert batch_k3(trainer, trainer) == 0.0
    with pytest.raises(InputError, match="differ in shape"):
        batch_k3(trainer, rollout[:, :2])


def test_threshold_cooldown_and_max_fires():
    seen = []
    t = Trigger(threshold=1e-3, cooldown=2, max_fires=2, on_fire=seen.append)
    values = [1e-4, 5e-3, 5e-3, 5e-3, 5e-3, 1e-4, 5e-3, float("nan")]
    fired = [t.feed_value(v) is not None for v in values]
    # fires at batch 1; 2 and 3 are in the cooldown; 4 fires (the second and last fire)
    assert fired == [False, True, False, False, True, False, False, False]
    assert [f.step for f in seen] == [1, 4] and t.values == values
    nan = Trigger(threshold=1e-3)
    assert nan.feed_value(float("nan")) is not None  # a broken batch is not under the threshold
    with pytest.raises(InputError):
        Trigger(threshold=-1)


def test_fed_log_probs_fire_on_a_mismatch():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 32, generator=g) * 5
    t = Trigger(threshold=1e-3, cooldown=0)
    assert t.feed(lp, lp + 1e-4 * torch.randn(4, 32, generator=g)) is None  # bf16-like noise: k3 ~ 5e-9
    fire = t.feed(lp, lp + 0.3 * torch.randn(4, 32, generator=g))  # k3 ~ 0.045
    assert fire is not None and fire.value > 1e-2 and fire.step == 1


@pytest.mark.parametrize("trainer, rollout, mask", [
    ([], [], None),  # an empty batch
    ([[-1.0, -2.0]], [[-3.0, -4.0]], [[0, 0]]),  # every token masked out (a mismatch there is not seen)
    (torch.zeros(2, 0), torch.zeros(2, 0), None),
])
def test_an_empty_or_fully_masked_batch_warns_and_is_not_counted_as_aligned(trainer, rollout, mask):
    from numbisect.live.trigger import EmptyBatchWarning

    assert math.isnan(batch_k3(trainer, rollout, mask))  # not 0.0: "no mismatch" was not measured
    t = Trigger(threshold=1e-3, cooldown=0)
    with pytest.warns(EmptyBatchWarning, match="batch 0 has no token to compare"):
        assert t.feed(trainer, rollout, mask) is None
    assert t.skipped == [0] and math.isnan(t.values[0]) and t.seen == 1 and not t.fires
    assert t.feed([[-1.0]], [[-1.5]]) is not None  # the next batch is judged as usual (step 1)


@pytest.mark.parametrize("call", [
    lambda: batch_k3([[-1.0, -2.0], [-1.0]], [[-1.0, -2.0], [-1.0]]),  # ragged
    lambda: batch_k3("-1.0", "-1.0"),
    lambda: batch_k3([["a"]], [["b"]]),
    lambda: batch_k3([[object()]], [[object()]]),
    lambda: batch_k3([[-1.0]], [[-1.0]], mask=[[0.5]]),
    lambda: batch_k3([[-1.0]], [[-1.0]], mask="yes"),
    lambda: batch_k3([[-1.0, -2.0]], [[-1.0, -2.0]], mask=[[1, 0], [1]]),
    lambda: Trigger(threshold="1e-3"),
    lambda: Trigger(threshold=True),
    lambda: Trigger(threshold=float("inf")),
    lambda: Trigger(cooldown=1.5),
    lambda: Trigger(max_fires=None),
    lambda: Trigger(on_fire=3),
    lambda: Trigger().feed_value("big"),
    lambda: Trigger().feed_value(torch.ones(3)),
    lambda: Trigger().feed_value(1.0, step="3"),
    lambda: Trigger().feed([[-1.0]], [[-1.0]], step=1.5),
])
def test_every_input_the_trigger_cannot_use_is_an_input_error(call):
    with pytest.raises(InputError):
        call()
