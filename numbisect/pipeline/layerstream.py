"""A reference that never holds the whole model: one decoder layer's weights at a time.

For models that do not fit in memory, against a dump (`--engine dump:DIR --ref-opt
layer_stream=true`):

1. The transformers model is built from config.json on the meta device (no memory);
   its modules are the real transformers classes.
2. Layer by layer, only that layer's tensors are read from the safetensors files
   (`safe_open`, nothing else), converted to the model's names (per-expert weights
   stacked into transformers' fused `experts.gate_up_proj` / `down_proj`), and the
   layer is materialised on the CPU with them.
3. The layer runs on every sample twice: on the reference's own stream (propagated:
   embed, layer 0, ..., final norm, logits, so the reference's log-probs come out
   too) and on the dump's input of that layer (local: its own error against the
   dumped output). Then it is freed before the next is loaded.

The comparison against the dump is `numbisect.pipeline.comparison.layer_streamed`.

Memory: one layer's weights plus one layer's activations (the stream of every sample,
tokens x hidden), plus the embedding and logits matrices while they run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from torch import nn

from numbisect.backends.base import check_checkpoint, load_config, parse_dtype
from numbisect.common.errors import InputError
from numbisect.model.arch import arch_for
from numbisect.patching.torchops import text_rotary


def _expert_pattern(arch) -> tuple[re.Pattern, str] | None:
    """(the checkpoint name of one expert's weight, as renamed by the family's `ckpt_renames`;
    the experts module's path inside a decoder layer); None for a dense family."""
    if "layers.{i}.moe.experts" not in arch.hf:
        return None
    layer = arch.hf_path("layers.{i}", 0)
    rel = arch.hf_path("layers.{i}.moe.experts", 0)[len(layer) + 1:]  # e.g. mlp.experts
    names = "|".join(re.escape(w) for w in arch.ckpt_expert_weights)
    return re.compile(rf"^(?P<pre>(?:.*\.)?){re.escape(rel)}\.(?P<e>\d+)\.(?P<w>{names})\.weight$"), rel


class LayerStreamRef:
    """The reference on a checkpoint, materialised one module at a time (see module doc)."""

    kind = "hf-layers"

    def __init__(self, path: str, dtype: str = "float32"):
        check_checkpoint(path)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers
        from safetensors import safe_open

        self.path, self.dtype_name, self.dtype = path, dtype, parse_dtype(dtype)
        self.config = load_config(path)
        self.arch = arch_for(self.config)
        self.experts = _expert_pattern(self.arch)
        self.units = self.arch.units(self.config)
        self.vocab_size = self.config.get_text_config().vocab_size
        self.files: dict[str, str] = {}  # tensor name -> file
        for f in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    self.files[k] = str(f)
        with torch.device("meta"):
            self.skeleton = getattr(transformers, self.arch.hf_auto).from_config(self.config, dtype=self.dtype)
        self.skeleton.eval()
        rotary = self.arch.rotary(self.skeleton)  # on the meta device: a real one from its config
        self.rotary = text_rotary(self.arch, type(rotary)(config=rotary.config))
        self.loaded_bytes = 0  # weights materialised right now
        self.peak_loaded_bytes = 0

    def describe(self) -> dict:
        return {"backend": "hf", "path": self.path, "dtype": self.dtype_name, "arch": self.arch.name,
                "options": {"layer_stream": True}}

    def close(self) -> None:
        pass

    # -- weights -----------------------------------------------------------------------------
    def _read(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor under `prefix`, named relative to it in transformers' layout."""
        from safetensors import safe_open

        keys = [k for k in self.files if k.startswith(prefix)]
        if not keys:
            raise InputError(f"{self.path}: no weights under {prefix!r} in the checkpoint")
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.files[k], []).append(k)
        for f, ks in by_file.items():
            with safe_open(f, framework="pt") as h:
                for k in ks:
                    t = h.get_tensor(k).to(self.dtype)
                    name = k[len(prefix):]
                    for old, new in self.arch.ckpt_renames.items():
                        name = name.replace(old, new)
                    m = self.experts[0].match(name) if self.experts else None
                    if m:
                        role = self.arch.ckpt_expert_weights[m["w"]]
                        experts.setdefault((m["pre"], role), {})[int(m["e"])] = t
                    else:
                        out[name] = t
        for pre in {p for p, _ in experts}:  # one expert per tensor -> transformers' fused layout
            gate, up, down = (experts[(pre, r)] for r in ("gate", "up", "down"))
            n = len(down)
            rel = self.experts[1]
            out[f"{pre}{rel}.gate_up_proj"] = torch.stack([torch.cat([gate[e], up[e]], 0) for e in range(n)])
            out[f"{pre}{rel}.down_proj"] = torch.stack([down[e] for e in range(n)])
        return out

    def materialise(self, module: nn.Module, prefix: str) -> nn.Module:
        sd = self._read(prefix)
        want = set(module.state_dict())
        missing, extra = sorted(want - set(sd)), sorted(set(sd) - want)
        if missing or extra:
            what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
            raise InputError(f"{self.path}: weights under {prefix!r} do not match config.json ({what})")
        module.to_empty(device="cpu")
        module.load_state_dict(sd, strict=True, assign=True)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        self.loaded_bytes += nbytes
        self.peak_loaded_bytes = max(self.peak_loaded_bytes, self.loaded_bytes)
        return module

    def free(self, module: nn.Module) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())
        module.to("meta")
        self.loaded_bytes -= nbytes

    # -- running ---------------------------------------------------------------------------------
    def run_layer(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One decoder layer on one sample's stream [T, hidden] (causal, positions 0..T-1)."""
        T = x.shape[0]
        h = x.to(self.dtype)[None]
        pos = torch.arange(T)[None]
        cos_sin = self.rotary(h, pos)
        mask = None
        if getattr(self.skeleton.config, "_attn_implementation", "sdpa") != "sdpa":
            mask = torch.full((T, T), float("-inf"), dtype=self.dtype).triu(1)[None, None]
        out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        return (out[0] if isinstance(out, tuple) else out)[0]

    @torch.inference_mode()
    def stream(self, samples, dump_inputs=None, on_layer=None):
        """Run the whole model one module at a time; returns per-sample token and full log-probs.

        `on_layer(i, layer)` is called while layer i is materialised (local comparisons).
        """
        with_images = next((s for s in samples if getattr(s, "images", None) is not None), None)
        if with_images is not None:
            raise InputError(f"--ref-opt layer_stream=true runs the language model only; the trace has images "
                             f"(line {with_images.line}): leave layer_stream off for image samples")
        path = self.arch.hf_path  # where the family keeps each module (arch map)
        module = self.skeleton.get_submodule
        emb = self.materialise(module(path("embed")), path("embed") + ".")
        hs = [emb(torch.tensor(s.ids)[None])[0] for s in samples]
        self.free(emb)
        for i in range(self.config.get_text_config().num_hidden_layers):
            layer = module(path("layers.{i}", i))
            self.materialise(layer, path("layers.{i}", i) + ".")
            hs = [self.run_layer(layer, h) for h in hs]
            if on_layer is not None:
                on_layer(i, layer, hs)
            self.free(layer)
        norm = self.materialise(module(path("final_norm")), path("final_norm") + ".")
        hs = [norm(h) for h in hs]
        self.free(norm)
        head_path = path("lm_head")
        if getattr(self.config.get_text_config(), "tie_word_embeddings", False) and f"{head_path}.weight" not in self.files:
            head = self.materialise(module(path("embed")), path("embed") + ".")
        else:
            head = self.materialise(module(head_path), head_path + ".")
        tok, full = [], []
        for s, h in zip(samples, hs):
            w = head.weight
            lp = torch.log_softmax((h[:-1] @ w.T).float(), dim=-1)
            full.append(lp)
            tok.append(lp.gather(1, torch.tensor(s.ids[1:])[:, None]).squeeze(1))
        self.free(head)
        return tok, full, hs
