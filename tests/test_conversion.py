"""Conversion bugs: the engine loads a damaged copy of the reference checkpoint.

A checkpoint converted wrongly (a norm weight scaled, gate and up projections swapped)
is the bug people ship between a trainer and an engine. The swaps must still carry the
whole reference unit (the self-check passes on the damaged copy) and the search must
name the damaged unit, on every fixture family, with a bf16 transformers engine.
"""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from conftest import hf, model_dir, short_trace
from numbisect.compare import Settings
from numbisect.errors import ExitCode
from numbisect.run import run
from numbisect.session import Session, Spec


def damaged_copy(name: str, dest, edit) -> str:
    """A copy of fixture `name` in `dest` whose weights `edit` changed in place."""
    out = dest / name
    shutil.copytree(model_dir(name), out)
    path = out / "model.safetensors"
    weights = load_file(path)
    edit(weights)
    save_file(weights, path, metadata={"format": "pt"})
    return str(out)


def scale_norm(layer: int):
    def edit(w):
        key = f"model.layers.{layer}.post_attention_layernorm.weight"
        w[key] = w[key] * 1.5
    return edit


def swap_gate_up(layer: int):
    """gate_proj <-> up_proj (Mixtral: w1 <-> w3) of every FFN weight of the layer (dense
    MLP, each expert, the shared expert)."""
    def edit(w):
        n = 0
        for key in list(w):
            if f"layers.{layer}." not in key:
                continue
            for gate, up in (("gate_proj", "up_proj"), (".w1.", ".w3.")):
                if gate in key:
                    other = key.replace(gate, up)
                    w[key], w[other] = w[other], w[key]
                    n += 1
        assert n, f"no gate projection in layer {layer}"
    return edit


CASES = [
    ("qwen3", scale_norm(1), ["layers.1.post_attn_norm"]),
    ("qwen3", swap_gate_up(2), ["layers.2.mlp"]),
    ("qwen3_moe", swap_gate_up(0), ["layers.0.moe.experts"]),
    ("glm4_moe", swap_gate_up(1), ["layers.1.moe.experts", "layers.1.moe.shared_expert"]),
    ("mixtral", scale_norm(0), ["layers.0.post_attn_norm"]),
    ("mixtral", swap_gate_up(2), ["layers.2.moe.experts"]),
]


@pytest.mark.parametrize("name,edit,culprits", CASES, ids=[f"{c[0]}-{c[1].__qualname__.split('.')[0]}" for c in CASES])
def test_a_damaged_checkpoint_copy_passes_the_self_check_and_is_named(name, edit, culprits, tmp_path):
    copy = damaged_copy(name, tmp_path, edit)
    spec = Spec(ref=f"hf:{model_dir(name)}", engine=f"hf:{copy}", trace=short_trace(name, 8))
    s = Session(spec, Settings(threshold=1e-6), backends={"ref": hf(name)})
    try:
        body, code = run(s, swap=None, strategy="hierarchical", max_trials=None, log=None, resume=None)
    finally:
        s.close()
    sc = body["self_check"]
    assert sc["passed"] and sc["k3_mean"] <= 1e-7, sc  # every unit swapped reproduces the reference
    assert body["baseline"]["value"] > 1e-6
    assert code == ExitCode.DIVERGED, body["search"]["stop_reason"]
    assert sorted(c["unit"] for c in body["culprits"]) == culprits
