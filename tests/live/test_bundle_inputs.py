"""What `bisect replay` runs a bundle with (numbisect.live.bundle.replay_inputs), from the
manifest alone: the threshold the fired batch was judged at when the live engine could not
be compared (TRL's compiled engine), and the faults the live engine had planted for its life
(NUMBISECT_ENGINE_FAULT), which the replay plants again."""

from numbisect.live.bundle import Bundle, replay_inputs


def manifest(**over) -> dict:
    m = {"parts": {"reference": "reference", "engine": "engine", "trace": "trace.jsonl", "engine_settings": "engine.json"},
         "reference": {"dtype": "float32"}, "engine": {"dtype": "float32", "faults": ["moe_combine_bf16@layers.0.moe"]},
         "fire": {"step": 0, "value": 1.3e-7, "threshold": 2e-9}, "finding": {"compare_refused": "compiled"}}
    m.update(over)
    return m


def test_without_a_live_comparison_the_replay_judges_at_the_triggers_threshold():
    inp = replay_inputs(Bundle("/b", manifest()))
    assert inp["threshold"] == 2e-9
    assert inp["engine_faults"] == ["moe_combine_bf16@layers.0.moe"]
    assert (inp["ref_dtype"], inp["engine_dtype"]) == ("float32", "float32")


def test_a_live_comparisons_threshold_wins_and_no_faults_is_an_empty_list():
    inp = replay_inputs(Bundle("/b", manifest(finding={"threshold": 1e-3}, engine={"dtype": "bfloat16"})))
    assert inp["threshold"] == 1e-3 and inp["engine_faults"] == []
    assert replay_inputs(Bundle("/b", manifest(fire=None, finding={})))["threshold"] is None  # replay's default then: 1e-3
