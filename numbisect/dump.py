"""Write an engine's activations in the layout `bisect compare --engine dump:DIR` reads.

Imports only torch, safetensors and the standard library, so any engine process
(a vLLM worker, a trainer) can import it without the rest of numbisect.

Layout (version 1)::

    DIR/manifest.json                  written at start and again at close (every rank, identical)
    DIR/rank{R}/{UNIT}.{PART}.safetensors
    DIR/rank{R}/logprobs.{PART}.safetensors
    DIR/rank{R}/COMPLETE               written last, once every file is on disk

- `manifest.json`: {"numbisect_dump": 1, "world_size": W, "dtype": "bfloat16",
  "config": <the model's config.json>, "config_sha256": sha256 of config.json's bytes
  (or null), "trace_sha256": sha256 of the trace file (or null), "samples": N,
  "tokens": [T_0, ..., T_{N-1}], "units": {UNIT: {"shard": "replicated" | "column" |
  "row"}}}. UNIT is a canonical numbisect unit name (`layers.2.attn`, `lm_head`, ...).
- Tensors of a unit file: `out.{i}`, the unit's output for sample i in canonical form
  `[T_i, ...]` (`lm_head`: the T_i - 1 rows of logits that predict tokens 1..T_i-1;
  a layer: the residual stream after it, hidden + residual); optionally `in.{i}`, its
  input (`[T_i, hidden]`; for a norm or a layer the residual stream before it). Any
  float dtype; the engine's own is best (bitwise comparisons). Vision units (`vision`,
  `vision.projector`) run for the samples with images only: their tensors are there
  for exactly those samples, with image patches / image tokens as rows.
- `logprobs.*.safetensors` (rank 0): `token.{i}`, float32 `[T_i - 1]`, log p(ids[t] |
  ids[:t]) for t = 1..T_i-1.
- Tensor parallel: each rank writes its own shard under `rank{R}`. `shard` says how
  the shards merge: `column` = concatenate along the last dim in rank order (column-
  parallel linears, vocab-parallel logits); `row` = the shards are partial sums, add
  them (row-parallel linears before their all-reduce); `replicated` = every rank holds
  the whole tensor, rank 0 is read.
- Recurrent state (linear attention: Gated DeltaNet layers of Qwen3.5 / Qwen3-Next),
  optional: in the file of the linear unit (`layers.{L}.attn`), `state.{i}`, the layer's
  state after sample i's last token, `[heads, k_dim, v_dim]`, and `state.{i}.{n}`, the
  state after its first n tokens (a chunk boundary, 0 < n < T_i). The manifest lists the
  units with states in "states": {UNIT: {"shard": "replicated" | "heads"}} (`heads`:
  each rank holds its heads, concatenated along dim 0 in rank order). A unit may have
  states without outputs. The state's own dtype is best (transformers: float32; vLLM: its
  mamba cache's).
- `COMPLETE`: JSON {"files": {NAME: {"bytes": n}}, "started": t0, "finished": t1}
  listing every file of that rank, and when its writer was made and closed (seconds
  since the epoch). A rank without it (a crashed engine) or a listed file of another
  size (a truncated copy) makes the whole dump refused; files it does not list are
  ignored. The ranks of one run write at the same time, so a rank whose writing
  finished before another's started is from another run (a stale directory left by
  an earlier dump) and the dump is refused. Sizes are checked, not contents.
- A unit's tensors may be split over several part files (`max_buffer_mb`); PART
  counts from 0000.

Use from forward hooks::

    w = DumpWriter("dump/", config="model/config.json", samples=n, tokens=[...], rank=r, world_size=W)
    w.hook(model.model.layers[0].self_attn, "layers.0.attn", shard="row")
    w.hook(model.model.layers[0], "layers.0", output="sum", input="sum")   # (hidden, residual) pairs
    for i, ids in enumerate(trace):
        w.begin(i)            # the next forward is sample i
        logits = model(ids)   # hooks record each unit's last call with the sample's row count
        w.logprobs(i, token_logprobs)
    w.close()                 # files, then COMPLETE

A linear-attention layer's recurrent state: `w.state("layers.0.attn", i, ssm_state)`
after sample i's forward; `w.state(unit, i, s, tokens=n)` after a prefill of its first n
tokens (a chunk boundary).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import torch

LAYOUT_VERSION = 1
SHARDS = ("replicated", "column", "row")
STATE_SHARDS = ("replicated", "heads")


def _atomic_write(path: Path, data: bytes) -> None:
    # A name of its own per process and thread: every rank writes the shared manifest.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _pair_sum(x):
    """(hidden, residual) -> hidden + residual (residual may be None)."""
    if isinstance(x, (tuple, list)):
        h, r = x[0], x[1] if len(x) > 1 else None
        return h if r is None else h + r
    return x


class DumpWriter:
    """Collects per-sample unit tensors of one rank and writes them in layout version 1."""

    def __init__(self, root, config, samples: int, tokens: list[int], rank: int = 0, world_size: int = 1,
                 dtype: str | None = None, trace_sha256: str | None = None, max_buffer_mb: float = 1024.0):
        self.root = Path(root)
        self.rank, self.world_size = int(rank), int(world_size)
        self.samples, self.tokens = int(samples), [int(t) for t in tokens]
        if len(self.tokens) != self.samples:
            raise ValueError(f"{len(self.tokens)} token counts for {self.samples} samples")
        if isinstance(config, (str, os.PathLike)):
            raw = Path(config).read_bytes()
            self.config, self.config_sha = json.loads(raw), hashlib.sha256(raw).hexdigest()
        else:
            self.config, self.config_sha = dict(config), None
        self.dtype = dtype
        self.trace_sha256 = trace_sha256
        self.max_bytes = int(max_buffer_mb * 2**20)
        self.units: dict[str, str] = {}
        self.states: dict[str, str] = {}
        self.buf: dict[str, dict[str, torch.Tensor]] = {}
        self.held = 0
        self.parts: dict[str, int] = {}
        self.files: dict[str, int] = {}
        self.current: int | None = None
        self.pending: dict[tuple[str, str], torch.Tensor] = {}
        self.handles: list = []
        self.started = time.time()
        self.dir = self.root / f"rank{self.rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        marker = self.dir / "COMPLETE"
        if marker.exists():
            marker.unlink()  # rewriting a dump: it is incomplete until close()
        _atomic_write(self.root / "manifest.json", (json.dumps(self.manifest(), indent=1) + "\n").encode())

    # -- recording -------------------------------------------------------------------------
    def declare(self, unit: str, shard: str = "replicated") -> None:
        if shard not in SHARDS:
            raise ValueError(f"shard must be one of {SHARDS}, got {shard!r}")
        self.units[unit] = shard

    def add(self, unit: str, sample: int, out: torch.Tensor | None = None, inp: torch.Tensor | None = None) -> None:
        if unit not in self.units:
            self.declare(unit)
        if out is not None:
            self._put(unit, f"out.{sample}", out)
        if inp is not None:
            self._put(unit, f"in.{sample}", inp)

    def declare_state(self, unit: str, shard: str = "replicated") -> None:
        """`unit` has states in this dump (every rank lists the same, as for `declare`)."""
        if shard not in STATE_SHARDS:
            raise ValueError(f"state shard must be one of {STATE_SHARDS}, got {shard!r}")
        self.states[unit] = shard

    def state(self, unit: str, sample: int, state: torch.Tensor, tokens: int | None = None,
              shard: str = "replicated") -> None:
        """Linear unit `unit`'s recurrent state [heads, k_dim, v_dim] after sample `sample`
        (`tokens` None or the sample's length), or after its first `tokens` tokens."""
        if not 0 <= sample < self.samples:
            raise ValueError(f"sample {sample} outside 0..{self.samples - 1}")
        if state.dim() == 4 and state.shape[0] == 1:
            state = state[0]
        if state.dim() != 3:
            raise ValueError(f"{unit}: a state is [heads, k_dim, v_dim], got shape {tuple(state.shape)}")
        n = self.tokens[sample]
        if tokens is not None and not 0 < int(tokens) <= n:
            raise ValueError(f"{unit}: state after {tokens} tokens of sample {sample}, which has {n}")
        self.declare_state(unit, shard)
        name = f"state.{sample}" if tokens is None or int(tokens) == n else f"state.{sample}.{int(tokens)}"
        self._put(unit, name, state)

    def logprobs(self, sample: int, token_logprobs: torch.Tensor) -> None:
        self._put("logprobs", f"token.{sample}", token_logprobs.float())

    def hook(self, module: torch.nn.Module, unit: str, output: str = "first", input: str | None = "first",
             shard: str = "replicated") -> None:
        """Record `module`'s output (and input) as `unit` for the sample set by `begin()`.

        output/input: "first" (a tensor, or the first of a tuple) or "sum" (a (hidden,
        residual) pair summed); input None records no input. Only calls whose row count
        is the sample's (T, or T - 1 for `lm_head`) count; the last such call is kept.
        """
        self.declare(unit, shard)
        read = {"first": _first, "sum": _pair_sum}
        rows_off = 1 if unit == "lm_head" else 0

        def pre(mod, args, kwargs):
            if input is None or self.current is None:
                return
            if input == "sum":
                x = _pair_sum(tuple(a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
                              or (kwargs.get("hidden_states"), kwargs.get("residual")))
            else:
                x = kwargs.get("hidden_states", next((a for a in args if isinstance(a, torch.Tensor)), None))
            if x is not None and x.shape[0] == self.tokens[self.current] - rows_off:
                self.pending[(unit, "in")] = x.detach().to("cpu", copy=True)

        def post(mod, args, kwargs, out):
            if self.current is None:
                return
            y = read[output](out)
            if isinstance(y, torch.Tensor) and y.shape[0] == self.tokens[self.current] - rows_off:
                self.pending[(unit, "out")] = y.detach().to("cpu", copy=True)

        self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(module.register_forward_hook(post, with_kwargs=True))

    def begin(self, sample: int) -> None:
        """The next forward is sample `sample` (what the previous one recorded is kept)."""
        self._commit()
        if not 0 <= sample < self.samples:
            raise ValueError(f"sample {sample} outside 0..{self.samples - 1}")
        self.current = sample

    def _commit(self) -> None:
        if self.current is not None:
            for (unit, which), t in self.pending.items():
                self.add(unit, self.current, **{which if which == "out" else "inp": t})
        self.pending = {}

    def _put(self, unit: str, name: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        self.buf.setdefault(unit, {})[name] = t
        self.held += t.numel() * t.element_size()
        while self.held > self.max_bytes and self.buf:
            self._spill(max(self.buf, key=lambda u: sum(x.numel() * x.element_size() for x in self.buf[u].values())))

    def _spill(self, unit: str) -> None:
        from safetensors.torch import save_file

        tensors = self.buf.pop(unit)
        part = self.parts.get(unit, 0)
        self.parts[unit] = part + 1
        path = self.dir / f"{unit}.{part:04d}.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        self.files[path.name] = path.stat().st_size
        self.held -= sum(x.numel() * x.element_size() for x in tensors.values())

    # -- finishing ---------------------------------------------------------------------------
    def manifest(self) -> dict:
        return {
            "numbisect_dump": LAYOUT_VERSION,
            "world_size": self.world_size,
            "dtype": self.dtype,
            "config": self.config,
            "config_sha256": self.config_sha,
            "trace_sha256": self.trace_sha256,
            "samples": self.samples,
            "tokens": self.tokens,
            "units": {u: {"shard": s} for u, s in self.units.items()},
            **({"states": {u: {"shard": s} for u, s in self.states.items()}} if self.states else {}),
        }

    def close(self) -> None:
        """Write what is buffered, the manifest, then this rank's COMPLETE marker (last)."""
        self._commit()
        self.current = None
        for h in self.handles:
            h.remove()
        self.handles = []
        for unit in list(self.buf):
            self._spill(unit)
        _atomic_write(self.root / "manifest.json", (json.dumps(self.manifest(), indent=1) + "\n").encode())
        done = {"files": {name: {"bytes": size} for name, size in sorted(self.files.items())},
                "started": self.started, "finished": time.time()}
        _atomic_write(self.dir / "COMPLETE", (json.dumps(done, indent=1) + "\n").encode())
