"""What a comparison measures, and the checks before it runs (`numbisect.pipeline.comparison` runs it).

1. Read the backend specs (`hf:DIR`, `vllm:DIR`, `dump:DIR`, `rollout`;
   `numbisect.backends.open_backend` opens them) and check that their configs agree and
   the trace fits the vocabulary and the position limit.
2. Token metrics of the reference's and the engine's (or a trial's) log-probs: k1/k2/k3,
   full-vocabulary KL, top-1 agreement, RL cost, per group (`token_report`).
3. Per unit: propagated error (each side on its own inputs) and local error (the
   engine unit fed the reference's input), with bitwise equality and ulps
   (`unit_report`); the first divergence and the local ranking drawn from them.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from numbisect.backends import check_opts, parse_spec  # noqa: F401  (re-exported: measure.check_opts, measure.parse_spec)
from numbisect.backends.base import Backend, ForwardResult, check_checkpoint
from numbisect.backends.options import HF_OPTS, VLLM_INTS, VLLM_RESERVED, parse_opts  # noqa: F401  (re-exported)
from numbisect.common.errors import InputError
from numbisect.common.jsonsafe import sanitize  # noqa: F401  (re-exported: numbisect.pipeline.measure.sanitize)
from numbisect.common.safeio import file_sha256
from numbisect.model.arch import arch_for
from numbisect.model.trace import Sample, Trace
from numbisect.model.units import INNER_KINDS, capture_names, local_feed_names  # noqa: F401 (read as measure.*)
from numbisect.pipeline import metrics as M
from numbisect.pipeline.capture import UnitStats

METRICS = ("k3-mean", "k3-p99", "kl-mean")


@dataclass
class Settings:
    """Everything that decides a verdict; recorded in the report."""

    threshold: float = 1e-3  # judged metric at or under this: aligned
    metric: str = "k3-mean"  # k3-mean, k3-p99 or kl-mean
    group: str = "completion"  # token group the verdict is judged on
    unit_tol: float = 1e-2  # relative L2 error above which a unit counts as diverged
    rl: M.RLThresholds = field(default_factory=M.RLThresholds)
    threshold_origin: dict | None = None  # where a `--threshold floor[xN]` came from (numbisect.commands.calibrate)

    @property
    def judges_kl(self) -> bool:
        """The verdict needs the full-vocabulary KL: only then does a trial (or what-if)
        take the engine's full logits, and a compare keep the reference's."""
        return self.metric == "kl-mean"

    def to_dict(self) -> dict:
        d = {"threshold": self.threshold, "metric": self.metric, "group": self.group, "unit_tol": self.unit_tol}
        if self.threshold_origin is not None:
            d["threshold_origin"] = self.threshold_origin
        return d


# -- backends ---------------------------------------------------------------------------------
def check_configs(ref_cfg, eng_cfg) -> None:
    """Refuse a pair whose configs cannot be compared unit by unit."""
    rc, ec = ref_cfg.get_text_config(), eng_cfg.get_text_config()
    for key in ("vocab_size", "num_hidden_layers", "hidden_size"):
        a, b = getattr(rc, key, None), getattr(ec, key, None)
        if a != b:
            raise InputError(f"ref and engine configs disagree on {key}: {a} vs {b}")
    ra, ea = arch_for(ref_cfg), arch_for(eng_cfg)
    if ra.name != ea.name:
        raise InputError(f"ref and engine architectures differ: {ra.name} vs {ea.name}")
    if [u.name for u in ra.units(ref_cfg)] != [u.name for u in ea.units(eng_cfg)]:
        raise InputError("ref and engine configs give different units (dense/MoE layers differ)")


def check_positions(trace: Trace, config, what: str) -> None:
    """Refuse, before any weights load, a sample longer than the model's position limit
    (`max_position_embeddings` of its text config), as vLLM refuses one longer than its
    max_model_len: naming the sample's trace line and its length."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        return
    for s in trace.samples:
        n = len(s.prompt_ids) + len(s.completion_ids)
        if n > limit:
            raise InputError(f"{trace.path}:{s.line}: the sample has {n} tokens; {what}'s max_position_embeddings is {limit}")


def check_pair(ref: Backend, eng: Backend) -> None:
    check_configs(ref.config, eng.config)


def checkpoint_digest(path: str) -> dict:
    check_checkpoint(path)
    out = {}
    for f in sorted(Path(path).iterdir()):
        if f.suffix == ".safetensors" or f.name == "config.json":
            out[f.name] = file_sha256(f)
    return out


def dump_digest(path: str) -> dict:
    """SHA-256 of a dump's manifest (it names the model config and trace digests)."""
    f = Path(path) / "manifest.json"
    return {"manifest.json": hashlib.sha256(f.read_bytes()).hexdigest()}


# -- token metrics ---------------------------------------------------------------------------
def rollout_result(trace: Trace) -> ForwardResult:
    """The engine side from the trace's own `rollout_logprobs` (NaN on prompt positions)."""
    out = []
    for s in trace.samples:
        if s.rollout_logprobs is None:
            field = ((s.source or {}).get("rollout_logprobs") or ("rollout_logprobs",))[0]
            raise InputError(f"{trace.path}:{s.line}: --engine rollout needs the rollout's log-probs ({field}) on every sample")
        lp = torch.full((len(s.ids) - 1,), math.nan, dtype=torch.float32)
        lp[len(s.prompt_ids) - 1 :] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        out.append(lp)
    return ForwardResult(token_logprobs=out, partial=True)


def group_names(trace: Trace) -> list[str]:
    return ["completion", "prompt"] + trace.group_names()


KL_CHUNK_ELEMENTS = 1 << 20  # full-vocabulary rows per KL chunk: rows x vocab (float64: 8 MB a temporary)


def token_report(samples: list[Sample], ref: ForwardResult, eng: ForwardResult, settings: Settings, groups: list[str],
                 detail: bool = True, kl: tuple[list, list] | None = None) -> dict:
    """Aggregates per group, RL cost and worst tokens over completion tokens.

    The full-vocabulary KL and top-1 agreement come from `kl` (per sample, from
    `position_kl`: a streamed compare computes them as it goes and keeps no full
    log-probs), else from both sides' `full_logprobs`, else they are None.
    The samples are joined into one tensor per quantity (token metrics and group masks
    element-wise, the KL in chunks of `KL_CHUNK_ELEMENTS`), so a trial costs a few dozen
    tensor ops, not a few per sample. `detail=False` (search trials) leaves out
    `per_sample` and `worst_tokens`, which only a report shows.
    """
    lens = [len(s.ids) - 1 for s in samples]
    for i, (a, b) in enumerate(zip(ref.token_logprobs, eng.token_logprobs)):
        if a.shape != b.shape:
            raise ValueError(f"sample {i}: shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    eng_lp = _cat(eng.token_logprobs)
    p = M.token_metrics(_cat(ref.token_logprobs), eng_lp)
    # A position the engine has no log-prob for (a rollout's prompt) is left out; any other
    # NaN is a broken value on a side that owes one (an engine that ran, or the reference)
    # and is judged as inf.
    nan = torch.isnan(eng_lp) if eng.partial else torch.zeros(eng_lp.shape, dtype=torch.bool)
    broken = torch.isnan(p["k3"]) & ~nan
    if bool(broken.any()):
        for key in ("log_r", "k1", "k2", "k3"):
            p[key] = torch.where(broken, torch.full_like(p[key], math.inf), p[key])
    top1 = None
    if kl is not None:
        kl, top1 = _cat(kl[0]), _cat(kl[1]).bool()
    elif ref.full_logprobs is not None and eng.full_logprobs is not None:
        kl, top1 = _full_kl_top1(ref.full_logprobs, eng.full_logprobs)
    out_groups = {}
    for g in groups:
        mask = _cat([s.position_mask(g) for s in samples], torch.bool) & ~nan
        n = int(mask.sum())
        entry: dict = {"tokens": n}
        for key in ("k1", "k2", "k3"):
            entry[key] = M.aggregate(p[key][mask])
        entry["kl"] = M.aggregate(kl[mask]) if (kl is not None and n) else None
        entry["top1_agree"] = float(top1[mask].double().mean()) if (kl is not None and n) else None
        out_groups[g] = entry
    judged = _cat([s.position_mask(settings.group) for s in samples], torch.bool) & ~nan
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    report = {
        "groups": out_groups,
        "rl_cost": M.rl_cost([p["log_r"][a:b][judged[a:b]] for a, b in zip(starts, starts[1:])], settings.rl),
    }
    if detail:
        report["worst_tokens"] = _worst(samples, p["k3"], judged, starts)
        report["per_sample"] = [
            {"sample": i, "line": s.line, "prompt_len": len(s.prompt_ids),
             "k3": [None if math.isnan(v) else _round(v) for v in p["k3"][a:b].tolist()]}
            for i, (s, a, b) in enumerate(zip(samples, starts, starts[1:]))
        ]
    report["value"] = judged_value(report, settings)
    return report


def _cat(ts: list, dtype=torch.float32) -> torch.Tensor:
    return torch.cat(ts) if ts else torch.zeros(0, dtype=dtype)


def position_kl(ref_full: torch.Tensor, eng_full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's full-vocabulary KL(engine || reference) per position, and whether the
    two sides' top-1 tokens agree there (never where either row holds a NaN: a NaN
    distribution is the worst divergence, inf KL, and agrees with nothing); rows in chunks of `KL_CHUNK_ELEMENTS` (the KL's
    float64 temporaries of a long sample at a real vocabulary would be gigabytes)."""
    rows = max(1, KL_CHUNK_ELEMENTS // max(1, ref_full.shape[-1]))
    if ref_full.shape[0] <= rows:
        broken = torch.isnan(ref_full).any(-1) | torch.isnan(eng_full).any(-1)
        return M.full_kl(eng_full, ref_full), (ref_full.argmax(-1) == eng_full.argmax(-1)) & ~broken
    parts = [position_kl(ref_full[a : a + rows], eng_full[a : a + rows]) for a in range(0, ref_full.shape[0], rows)]
    return torch.cat([k for k, _ in parts]), torch.cat([t for _, t in parts])


class PositionKL:
    """Per-position KL and top-1 agreement gathered sample by sample (`position_kl`), so
    no sample's full log-probs need be kept; none at all once a sample comes without
    engine logits (a dump without lm_head). `result()` is `token_report`'s `kl`."""

    def __init__(self):
        self.kl: list = []
        self.top1: list = []
        self.complete = True

    def add(self, ref_full: torch.Tensor, eng_full: torch.Tensor | None) -> None:
        if eng_full is None:
            self.complete = False
        elif self.complete:
            k, t = position_kl(ref_full, eng_full)
            self.kl.append(k)
            self.top1.append(t)

    def result(self) -> tuple[list, list] | None:
        return (self.kl, self.top1) if self.complete else None


def _full_kl_top1(refs: list, engs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position full-vocabulary KL and top-1 agreement, samples joined in chunks."""
    kl, top1 = [], []
    i = 0
    while i < len(refs):
        j, rows = i, 0
        while j < len(refs) and (j == i or (rows + refs[j].shape[0]) * refs[j].shape[-1] <= KL_CHUNK_ELEMENTS):
            rows += refs[j].shape[0]
            j += 1
        r, e = (refs[i], engs[i]) if j == i + 1 else (torch.cat(refs[i:j]), torch.cat(engs[i:j]))
        k, t = position_kl(r, e)
        kl.append(k)
        top1.append(t)
        i = j
    return _cat(kl), _cat(top1).bool()


def _worst(samples, k3: torch.Tensor, judged: torch.Tensor, starts: list[int], k: int = 10) -> list[dict]:
    """`metrics.worst_tokens` over the judged tokens with k3 > 0, given only the candidates
    (every value at or above the k-th largest), so no Python object is made per token."""
    pos = torch.nonzero(judged & (k3 > 0)).flatten()
    if not pos.numel():
        return []
    vals = k3[pos]
    kth = torch.topk(vals, min(k, vals.numel())).values[-1]
    keep = pos[vals >= kth].tolist()
    index = []
    for flat in keep:
        i = bisect.bisect_right(starts, flat) - 1
        j = flat - starts[i]
        index.append((i, j + 1, samples[i].ids[j + 1]))
    return M.worst_tokens(k3[keep], index, k=k)


def judged_value(tokens: dict, settings: Settings) -> float:
    g = tokens["groups"].get(settings.group)
    if g is None or not g["tokens"]:
        raise InputError(f"no tokens in group {settings.group!r} to judge on")
    if settings.metric == "k3-mean":
        return float(g["k3"]["mean"])
    if settings.metric == "k3-p99":
        return float(g["k3"]["p99"])
    if g["kl"] is None:
        raise InputError("--metric kl-mean needs full logits on both sides (not available with --engine rollout)")
    return float(g["kl"]["mean"])


def _round(v: float) -> float:
    return float(f"{v:.4g}")


# -- unit metrics ----------------------------------------------------------------------------
def unit_report(units, ref: ForwardResult, prop: ForwardResult | None, local: ForwardResult | None, engine_dtype, settings) -> list[dict]:
    rows = []
    for u in units:
        row = {"name": u.name, "kind": u.kind, "layer": u.layer, "parent": u.parent, "propagated": None, "local": None}
        if prop is not None and prop.captures.get(u.name) and ref.captures.get(u.name):
            row["propagated"] = _unit_error(ref.captures[u.name], prop.captures[u.name], engine_dtype)
        if local is not None and local.captures.get(u.name) and ref.captures.get(u.name):
            row["local"] = _unit_error(ref.captures[u.name], local.captures[u.name], engine_dtype)
        rows.append(row)
    return rows


def _unit_error(refs: list[torch.Tensor], engs: list[torch.Tensor], engine_dtype) -> dict:
    if len({r[:1].reshape(min(1, r.shape[0]), -1).shape[1] for r in refs}) > 1:
        # rows as wide as the sample (an indexer's [T, T] selection mask): they cannot be
        # joined, so sample by sample, as a streamed comparison folds them (ULP floor per sample)
        st = UnitStats(engine_dtype)
        for i, (r, e) in enumerate(zip(refs, engs)):
            st.update(r, e, i)
        return st.result()
    err = M.activation_error_multi([r.double() for r in refs], [e.double() for e in engs])
    ref_all = torch.cat([r.reshape(r.shape[0], -1).float() for r in refs])
    eng_all = torch.cat([e.reshape(e.shape[0], -1).float() for e in engs])
    err["ulps"] = M.ulp_stats(ref_all, eng_all, engine_dtype)
    return err


def first_divergence(rows: list[dict], settings: Settings, key: str = "propagated") -> dict:
    bitwise = next((r["name"] for r in rows if r[key] and not r[key]["ulps"]["bitwise_equal"]), None)
    above = next((r["name"] for r in rows if r[key] and _num(r[key]["rel_l2"]) > settings.unit_tol), None)
    return {"bitwise": bitwise, "above_tol": above}


def _num(x) -> float:
    """A metric for ranking: None and NaN (nothing can be said to be small) count as inf."""
    v = float("inf") if x is None else float(x)
    return float("inf") if math.isnan(v) else v


def local_ranking(rows: list[dict], layers: bool = False) -> dict[str, int]:
    """Units ranked by their own (teacher-forced) relative error, 1 = largest. A NaN error
    ranks as the largest (nothing can be said to be small); a zero error is not ranked;
    equal errors go by name. Decoder layers (which hold the other units) are left out;
    with `layers` they alone are ranked (a layer-streamed comparison measures nothing else)."""
    scored = [
        (r["local"]["rel_l2"], r["name"])
        for r in rows
        if r["local"] and (r["kind"] == "layer") == layers and _num(r["local"]["rel_l2"]) > 0
    ]
    scored.sort(key=lambda t: (-_num(t[0]), t[1]))
    return {name: i + 1 for i, (_, name) in enumerate(scored)}






def env_threads() -> int:
    return torch.get_num_threads()
