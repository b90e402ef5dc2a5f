"""The comparison pipeline (`numbisect.pipeline.comparison`) on its own inputs, without a Session;
the one local ranking every mode uses; and the hook that hands out a run's comparison
before its trials (the TUI shows it while the search runs)."""

from __future__ import annotations

import math

from conftest import session

from numbisect.commands.run import run
from numbisect.pipeline import comparison as P
from numbisect.pipeline.measure import local_ranking


def _row(name, kind, rel):
    err = None if rel is None else {"rel_l2": rel}
    return {"name": name, "kind": kind, "local": err}


def test_one_local_ranking_puts_a_nan_error_first_and_ranks_layers_only_when_asked():
    rows = [_row("layers.0", "layer", 0.2), _row("layers.1", "layer", math.nan), _row("layers.2", "layer", 0.2),
            _row("layers.3", "layer", 0.0), _row("layers.0.attn", "attn", 0.5), _row("layers.1.attn", "attn", None)]
    # units: decoder layers left out (they hold the units)
    assert local_ranking(rows) == {"layers.0.attn": 1}
    # a layer-streamed comparison measures layers alone: NaN is the worst, a tie goes by name, zero is not ranked
    assert local_ranking(rows, layers=True) == {"layers.1": 1, "layers.0": 2, "layers.2": 3}


def test_the_pipeline_runs_on_explicit_inputs_and_the_session_reports_what_it_returns():
    s = session("qwen3", "hf", ref_dtype="float32", engine_dtype="float32", faults=["output_noise=1e-1@layers.1.mlp"],
                samples=2, threshold=1e-6)
    sides = P.Sides(ref=s.ref, engine=s.engine, trace=s.trace, samples=s.samples,
                    settings=s.settings, groups=s.groups, faults=s.faults)
    c = P.compare(sides, local=True)
    assert isinstance(c, P.Comparison) and c.verdict == "diverged"
    assert min(c.local_ranking, key=c.local_ranking.get) == "layers.1.mlp"
    assert c.first_divergence["above_tol"] == "layers.1.mlp"
    assert c.capture.mode == "stats" and c.ref_tokens.full_logprobs is None  # streamed: nothing tokens x vocab kept
    body = s.compare(local=True)
    assert body == P.report_body(c)
    assert s.reference_tokens() is s.comparison.ref_tokens  # the trials reuse the streamed log-probs
    whole = P.whole_run(sides, local=True)  # every tensor kept: the same units, the same verdict
    assert whole.verdict == c.verdict and whole.local_ranking.keys() == c.local_ranking.keys()
    assert whole.ref_result is sides.ref_result is not None


def test_a_run_hands_out_its_comparison_before_the_first_trial():
    s = session("qwen3", "hf", ref_dtype="float32", engine_dtype="float32", faults=["output_noise=1e-1@layers.1.mlp"],
                samples=2, threshold=1e-6)
    seen, trials = [], []
    body, _ = run(s, swap=["mlp"], strategy="hierarchical", max_trials=None, log=None, resume=None,
                  on_trial=trials.append, on_baseline=lambda b: seen.append((len(trials), dict(b))))
    [(trials_then, compared)] = seen
    assert trials_then == 0 and "self_check" not in compared and trials
    assert {k: body[k] for k in compared} == compared
    assert body["swap"]["fixed"] and body["search"]["verdict"] == "culprits"
