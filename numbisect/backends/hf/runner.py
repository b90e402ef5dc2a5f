"""The `hf` backend's runner: a transformers model on a local checkpoint, batched with right padding.

Right padding with an attention mask leaves every real token's computation causal and
unchanged; captures are cut back to each sample's length. Samples with images (a
multimodal family) hand the model their pixel inputs too; the vision units' rows are
image patches or image tokens, split back per sample (samples without images have none).

Decode mode (`forward(..., mode="decode")`) runs each sample as a rollout would with
transformers' KV cache: the prompt in one forward, then one forward per completion
token with `past_key_values`; per-step captures are stitched back in token order
(`steps.Steps`; the last completion token is fed too, its logits dropped).
"""

from __future__ import annotations

import copy
import os

import torch

from numbisect.backends.base import (
    DTYPES,
    Backend,
    ForwardResult,
    fail,
    hidden_arg,
    with_hidden,
)
from numbisect.backends.hf import (
    faults,
    gdn,
    indexer,
    recurrent,
    rope,
    routing,
    swap,
    whatif,
)
from numbisect.backends.steps import Steps, decode_captures
from numbisect.common.errors import InputError
from numbisect.model.units import VISION_KINDS
from numbisect.patching.ledger import Ledger
from numbisect.patching.probes.selection import selection_mask
from numbisect.patching.torchops import first, gate_input, head_rows


def open_hf(path: str, dtype: str, opts: dict) -> HFBackend:
    """The registry's loader (numbisect.backends.BACKENDS["hf"])."""
    if "layer_stream" in opts:
        raise InputError("layer_stream=true needs --engine dump:DIR (the layers' inputs come from the dump)")
    return HFBackend(path, dtype, **opts)


class HFBackend(Backend):
    kind = "hf"
    modes = ("prefill", "decode")
    module_names = "hf"

    def __init__(
        self,
        path: str,
        dtype: str = "float32",
        attn_implementation: str | None = None,
        experts_implementation: str | None = None,
        batch_size: int = 1,  # 1: no padding, so a swapped engine can match the reference bit for bit
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"bad hf option batch_size={batch_size}: expected an integer >= 1")
        super().__init__(path, dtype)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # stderr is for numbisect's own progress

        kwargs = {}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        if experts_implementation:
            kwargs["experts_implementation"] = experts_implementation
        try:
            auto = getattr(transformers, self.arch.hf_auto)
            self.model, info = auto.from_pretrained(
                path,
                dtype=self.dtype,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
                use_safetensors=True,
                trust_remote_code=False,
                local_files_only=True,
                **kwargs,
            )
        except (ValueError, TypeError) as e:
            raise InputError(f"{path}: {str(e).splitlines()[0]}") from None
        except Exception as e:
            raise fail(e, f"cannot load {path} with transformers") from None
        bad = [("missing from the checkpoint", k) for k in sorted(info.get("missing_keys") or [])]
        bad += [("not used by config.json", k) for k in sorted(info.get("unexpected_keys") or [])]
        bad += [(f"shape {tuple(a)} in the checkpoint, {tuple(b)} by config.json", k) for k, a, b in info.get("mismatched_keys") or []]
        if bad:
            why, key = bad[0]
            raise InputError(f"{path}: weights do not match config.json: {len(bad)} tensors differ, e.g. {key} ({why})")
        self.model.eval()
        rope.install(self)  # MLA's rotary part as a module per attention (`rope` units)
        gdn.install(self)  # Gated DeltaNet's conv and gates as modules (`conv`, `gates` units)
        self.options = {
            "attn_implementation": attn_implementation,
            "experts_implementation": experts_implementation,
            "batch_size": batch_size,
        }
        self.batch_size = batch_size

    @classmethod
    def of(cls, model, label: str = "live:transformers") -> HFBackend:
        """A backend on a transformers model already in memory (a trainer's, numbisect.live),
        loaded from nothing and changed in nothing: no rope or Gated DeltaNet modules are
        installed (a family that needs them is refused by numbisect.live), its training
        flag, `requires_grad` and gradients are the caller's to keep (`forward` runs under
        `torch.inference_mode`). Its dtype is the model's own."""
        names = {v: k for k, v in DTYPES.items()}
        dtype = getattr(model, "dtype", None)
        if dtype not in names:
            raise InputError(f"the reference model is {dtype}; numbisect compares {', '.join(DTYPES)} models")
        config = model.config
        if not getattr(config, "architectures", None):  # built from its config, not loaded: its class names it
            config = copy.copy(config)  # the user's config is left as it is
            config.architectures = [type(model).__name__]
        self = cls.__new__(cls)
        self.adopt(label, names[dtype], config)
        self.model = model
        self.options = {"attn_implementation": None, "experts_implementation": None, "batch_size": 1}
        self.batch_size = 1
        return self

    @property
    def root(self):
        return self.model

    def describe(self) -> dict:
        return {**super().describe(), "options": self.options}

    # -- state changes (Backend's interface; each in its module of this package) ---------
    def plant_fault(self, fault, ledger: Ledger) -> None:
        faults.plant_fault(self, fault, ledger)

    def swap_unit(self, unit, donor, ledger: Ledger) -> None:
        swap.swap_unit(self, unit, donor, ledger)

    def install_routing_probe(self, probe, ledger: Ledger) -> None:
        routing.install_probe(self, probe, ledger)

    def install_whatif(self, whatif_name: str, unit, donor, faults, ledger: Ledger) -> list:
        return whatif.install(self, whatif_name, unit, ledger)

    def install_selection_probe(self, probe, ledger: Ledger) -> None:
        indexer.install_probe(self, probe, ledger)

    def install_state_probe(self, probe, ledger: Ledger) -> None:
        recurrent.install_probe(self, probe, ledger)

    def forward(self, samples, *, full_logits=False, capture=(), capture_inputs=(), feed=None, mode="prefill") -> ForwardResult:
        self.check_mode(mode)
        res = ForwardResult(token_logprobs=[], full_logprobs=[] if full_logits else None)
        for u in capture:
            res.captures[u] = []
        for u in capture_inputs:
            res.inputs[u] = []
        has_img = [s.images is not None for s in samples]
        if mode == "decode":
            if any(has_img):
                raise InputError("--engine-mode decode takes text-only traces: this one has images (run it in prefill mode)")
            for i, s in enumerate(samples):
                self._forward_decode(s, i, full_logits, capture, capture_inputs, {u: xs[i] for u, xs in (feed or {}).items()}, res)
            return res
        for start in range(0, len(samples), self.batch_size):
            end = start + self.batch_size
            batch = samples[start:end]
            fed = {}
            for u, xs in (feed or {}).items():  # vision units' lists hold image samples only
                lo, hi = (sum(has_img[:start]), sum(has_img[:end])) if self._rows_kind(u) else (start, end)
                fed[u] = xs[lo:hi]
            self._forward_batch(batch, full_logits, capture, capture_inputs, fed, res)
        return res

    def _canonical_input(self, name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """A unit call's input as captured (and fed): its hidden states (an `out_gate`'s core
        output and gate together, `gate_input`; never fed: `INNER_KINDS`)."""
        if self.unit(name).kind == "out_gate":
            return gate_input(args, self.config)
        return hidden_arg(args, kwargs)

    def _rows_kind(self, name: str) -> bool:
        return self.unit(name).kind in VISION_KINDS

    def _image_inputs(self, batch, ids: torch.Tensor) -> dict:
        """pixel_values, image_grid_thw and the token types a multimodal model takes."""
        imgs = [s.images for s in batch if s.images is not None]
        if not imgs:
            return {}
        if not self.arch.vision:
            raise InputError(f"the trace has images but {self.arch.name} takes none (line {batch[0].line})")
        tok = getattr(self.config, "image_token_id", None)
        return {
            "pixel_values": torch.cat([i.pixel_values for i in imgs]).to(self.dtype),
            "image_grid_thw": torch.cat([i.grid_thw for i in imgs]),
            "mm_token_type_ids": (ids == tok).int(),
        }

    @torch.inference_mode()
    def _forward_batch(self, batch, full_logits, capture, capture_inputs, feed, res: ForwardResult) -> None:
        lens = [len(s.ids) for s in batch]
        B, T = len(batch), max(lens)
        ids = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.long)
        for b, s in enumerate(batch):
            ids[b, : lens[b]] = torch.tensor(s.ids)
            mask[b, : lens[b]] = 1

        merge = getattr(getattr(self.config, "vision_config", None), "spatial_merge_size", 1) ** 2
        patches = [s.images.patches for s in batch if s.images is not None]

        def split_rows(t: torch.Tensor, tokens: bool) -> list[torch.Tensor]:
            """Vision units: rows are patches (inputs) or merged image tokens (outputs)."""
            sizes = [p // merge for p in patches] if tokens else patches
            t = t.reshape(sum(sizes), -1) if t.shape[0] != sum(sizes) else t
            return [x.detach().to("cpu", copy=True) for x in torch.split(t, sizes)]

        def split(t: torch.Tensor, kind: str = "") -> list[torch.Tensor]:
            t = head_rows(kind, t, self.config)
            if t.dim() == 2:  # flat [B*T, ...] (MoE router/experts see flattened tokens)
                t = t.view(B, T, -1)
            return [t[b, : lens[b]].detach().to("cpu", copy=True) for b in range(B)]

        def pad(xs: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((B, T) + tuple(xs[0].shape[1:]), dtype=like.dtype)
            for b, x in enumerate(xs):
                out[b, : x.shape[0]] = x.to(like.dtype)
            return out.view(like.shape)

        with Ledger() as hooks:
            for name in set(capture) | set(capture_inputs) | set(feed):
                mod = self.module(name)

                rows = self._rows_kind(name)

                def pre(m, args, kwargs, name=name, rows=rows):
                    x = self._canonical_input(name, args, kwargs)
                    if name in feed and x is not None:
                        new = torch.cat(feed[name]).to(x.dtype).view(x.shape) if rows else pad(feed[name], x)
                        args, kwargs = with_hidden(args, kwargs, x, new)
                        x = new
                    if name in capture_inputs and x is not None and rows:
                        res.inputs[name].extend(split_rows(x, tokens=False))
                    elif name in capture_inputs and x is not None:
                        xs = split(x)
                        res.inputs[name].extend(v[:-1] for v in xs) if name == "lm_head" else res.inputs[name].extend(xs)
                    return args, kwargs

                def post(m, args, kwargs, out, name=name, rows=rows):
                    if name in capture:
                        t = first(out)
                        if rows:  # the tower's model output: its pooler_output is what the LM gets
                            t = getattr(t, "pooler_output", t)
                            res.captures[name].extend(split_rows(t, tokens=True))
                        elif name == "lm_head":
                            res.captures[name].extend(x[:-1] for x in split(t))
                        elif self.unit(name).kind == "indexer":  # key ids -> the [n, n] mask of keys picked
                            res.captures[name].extend(selection_mask(t[b, : lens[b]], 0, lens[b]) for b in range(B))
                        else:
                            res.captures[name].extend(split(t, self.unit(name).kind))

                hooks.hooks(mod, pre=pre, post=post)
            try:
                logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False, **self._image_inputs(batch, ids)).logits
            except (RuntimeError, IndexError, ValueError) as e:
                raise fail(e, f"{self.path}: the transformers forward failed") from None
        logp = torch.log_softmax(logits.float(), dim=-1)
        for b in range(B):
            n = lens[b]
            lp = logp[b, : n - 1]
            res.token_logprobs.append(lp.gather(1, ids[b, 1:n, None]).squeeze(1).clone())
            if res.full_logprobs is not None:
                res.full_logprobs.append(lp.clone())

    @torch.inference_mode()
    def _forward_decode(self, sample, index, full_logits, capture, capture_inputs, feed, res: ForwardResult) -> None:
        """One sample: prefill the prompt, then one token per forward with the KV cache."""
        T, P = len(sample.ids), len(sample.prompt_ids)
        steps = Steps(T)
        capture, capture_inputs = decode_captures(self, capture), decode_captures(self, capture_inputs)
        seen: dict[str, list] = {u: [] for u in capture}
        seen_in: dict[str, list] = {u: [] for u in capture_inputs}

        def flat(t: torch.Tensor) -> torch.Tensor:
            return t[0] if t.dim() == 3 else t  # [1, n, ...] or flat [n, ...] (MoE router/experts)

        with Ledger() as hooks:
            for name in set(capture) | set(capture_inputs) | set(feed):
                mod = self.module(name)

                def pre(m, args, kwargs, name=name):
                    x = self._canonical_input(name, args, kwargs)
                    if x is None:  # the embedding: input ids [1, n]
                        tokens = next(a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor))
                        m.__dict__["_numbisect_span"] = steps.take(name, tokens.shape[-1])
                        return args, kwargs
                    span = steps.take(name, flat(x).shape[0])
                    m.__dict__["_numbisect_span"] = span
                    fed = feed.get(name)
                    if fed is not None and span[1] <= fed.shape[0]:
                        new = fed[span[0] : span[1]].to(x.dtype).view(x.shape)
                        args, kwargs = with_hidden(args, kwargs, x, new)
                        x = new
                    if name in seen_in:
                        seen_in[name].append((*span, flat(x).detach().to("cpu", copy=True)))
                    return args, kwargs

                def post(m, args, kwargs, out, name=name):
                    if name in seen:
                        span = m.__dict__["_numbisect_span"]
                        t = flat(head_rows(self.unit(name).kind, first(out), self.config))
                        if self.unit(name).kind == "indexer":  # key ids -> rows of the [T, T] mask of keys picked
                            t = selection_mask(t, span[0], T)
                        seen[name].append((*span, t.detach().to("cpu", copy=True)))

                hooks.hooks(mod, pre=pre, post=post)
            ids = torch.tensor([sample.ids])
            try:
                out = self.model(input_ids=ids[:, :P], use_cache=True)
                logits = [out.logits[0]]
                past = out.past_key_values
                for t in range(P, T):  # the last token too, so its activations are captured
                    out = self.model(input_ids=ids[:, t : t + 1], past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    logits.append(out.logits[0])
            except (RuntimeError, IndexError, ValueError) as e:
                raise fail(e, f"{self.path}: the transformers decode failed") from None
        logp = torch.log_softmax(torch.cat(logits)[: T - 1].float(), dim=-1)
        res.token_logprobs.append(logp.gather(1, ids[0, 1:, None]).squeeze(1).clone())
        if res.full_logprobs is not None:
            res.full_logprobs.append(logp.clone())
        for name in capture:
            res.captures[name].append(steps.stitch(name, seen[name], index))
        for name in capture_inputs:
            if seen_in[name]:
                res.inputs[name].append(steps.stitch(name, seen_in[name], index))
