"""The `dump` engine: activations an engine wrote with `numbisect.dump` (layout in its docstring).

Nothing runs: `sample(i)` reads sample i's dumped log-probs and unit tensors, merging
tensor-parallel shards (column: concatenated along the last dim in rank order; row:
partial sums added). Opening checks everything that can be checked before a forward:
the layout version, every rank's COMPLETE marker and file sizes (a crashed or
truncated dump is refused), the unit names, that every listed unit has every sample,
the trace (sample count and token counts) and every tensor's shape after merging.
Recurrent states of linear-attention units (optional, manifest "states"): every sample's
final state on every rank that holds one, one shape per unit, boundaries inside the
sample; `state(unit, i, tokens)` reads one, merging head shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from numbisect.backends.base import Backend, parse_dtype
from numbisect.backends.mla_rope import width as rope_width
from numbisect.common.errors import InputError
from numbisect.dump import LAYOUT_VERSION, SHARDS, STATE_SHARDS, DumpWriter
from numbisect.model.arch import arch_for
from numbisect.model.trace import show
from numbisect.model.units import VISION_KINDS, local_feed_names, nearby_names
from numbisect.patching.probes import state as RS
from numbisect.patching.torchops import conv_width, gate_width, gates_width

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _is_int(x, least: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= least


def _check_manifest(m: dict, mpath) -> None:
    """The manifest's fields have the layout's types (one line naming the first that does not)."""
    for key in ("world_size", "config", "samples", "tokens", "units"):
        if key not in m:
            raise InputError(f"{mpath}: manifest has no {key!r}")
    bad = None
    if not _is_int(m["world_size"], 1):
        bad = f"world_size must be an integer >= 1, got {show(m['world_size'])}"
    elif not isinstance(m["config"], dict):
        bad = f"config must be an object (the model's config.json), got {type(m['config']).__name__}"
    elif not _is_int(m["samples"], 1):
        bad = f"samples must be an integer >= 1, got {show(m['samples'])}"
    elif not isinstance(m["tokens"], list) or len(m["tokens"]) != m["samples"] or not all(_is_int(t, 2) for t in m["tokens"]):
        bad = f"tokens must list {m['samples']} token counts (integers >= 2), got {show(m['tokens'])[:80]}"
    elif not isinstance(m["units"], dict) or not all(v is None or isinstance(v, dict) for v in m["units"].values()):
        bad = 'units must map each unit name to {"shard": ...}'
    if bad:
        raise InputError(f"{mpath}: {bad}")


def _config_from_dict(cfg: dict, where: str):
    from transformers import AutoConfig

    try:
        kw = {k: v for k, v in cfg.items() if k != "model_type"}
        return AutoConfig.for_model(cfg["model_type"], **kw)
    except Exception as e:
        raise InputError(f"{where}: the manifest's config is not a usable config.json ({str(e).splitlines()[0]})") from None


def open_dump(path: str, dtype: str, opts: dict, trace=None) -> DumpBackend:
    """The registry's loader (numbisect.backends.BACKENDS["dump"]): the dump's own dtype is
    used; a session opens it with its trace (`open_backend(..., trace=trace)`) to check it."""
    return DumpBackend(path, trace)


class DumpBackend(Backend):
    """Activations an engine wrote: nothing runs, so nothing can be planted, swapped or
    probed (the interface's state changes refuse, naming the backend)."""

    kind = "dump"
    recorded = True

    def __init__(self, path: str, trace=None):
        self.path = path
        root = Path(path)
        if not root.is_dir():
            raise InputError(f"dump directory not found: {path}")
        mpath = root / "manifest.json"
        if not mpath.is_file():
            raise InputError(f"{path}: not a numbisect dump (no manifest.json)")
        try:
            m = json.loads(mpath.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"{mpath}: unreadable manifest ({e})") from None
        if not isinstance(m, dict) or "numbisect_dump" not in m:
            raise InputError(f"{mpath}: not a numbisect dump manifest (no numbisect_dump version)")
        ver = m["numbisect_dump"]
        if not isinstance(ver, int) or isinstance(ver, bool):
            raise InputError(f"{mpath}: numbisect_dump must be an integer layout version, got {show(ver)}")
        if ver != LAYOUT_VERSION:
            raise InputError(f"{path}: dump layout version {ver!r} is unknown; this numbisect reads version {LAYOUT_VERSION}")
        _check_manifest(m, mpath)
        self.manifest = m
        self.world = int(m["world_size"])
        self.config = _config_from_dict(m["config"], str(mpath))
        self.arch = arch_for(self.config)
        self.units = self.arch.units(self.config)
        self.unit_by_name = {u.name: u for u in self.units}
        self.vocab_size = self.config.get_text_config().vocab_size
        self.dtype_name = m.get("dtype") or "bfloat16"
        self.dtype = parse_dtype(self.dtype_name)
        self.options = {"world_size": self.world}
        self._files = self._check_complete(root)
        self.dumped = {}
        for name, info in m["units"].items():
            if name not in self.unit_by_name:
                near = nearby_names(name, list(self.unit_by_name))
                raise InputError(f"{path}: unknown unit {name!r} in the manifest" + (f"; nearby: {', '.join(near)}" if near else ""))
            shard = (info or {}).get("shard", "replicated")
            if shard not in SHARDS:
                raise InputError(f"{path}: unit {name}: shard {shard!r} is not one of {', '.join(SHARDS)}")
            self.dumped[name] = shard
        self.states = self._state_units(m.get("states", {}), mpath)
        self._index = self._index_tensors(root)
        self.state_bounds = self._check_states()
        if trace is not None:
            self.check_trace(trace)

    # -- checks --------------------------------------------------------------------------------
    def _check_complete(self, root: Path) -> dict[int, list[Path]]:
        files, windows = {}, {}
        for r in range(self.world):
            d = root / f"rank{r}"
            marker = d / "COMPLETE"
            if not marker.is_file():
                raise InputError(f"{self.path}: dump is incomplete: rank {r} has no COMPLETE marker (the engine stopped "
                                 "before it finished writing); refusing to read it")
            try:
                done = json.loads(marker.read_text())
                listed = done["files"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise InputError(f"{marker}: unreadable COMPLETE marker ({e})") from None
            if not isinstance(listed, dict) or not all(isinstance(v, dict) for v in listed.values()):
                raise InputError(f'{marker}: "files" must map each file name to {{"bytes": n}}')
            if isinstance(done.get("started"), (int, float)) and isinstance(done.get("finished"), (int, float)):
                windows[r] = (float(done["started"]), float(done["finished"]))
            files[r] = []
            for name, info in listed.items():
                f = d / name
                if not f.is_file():
                    raise InputError(f"{self.path}: rank{r}/{name} is listed as written but missing")
                size = f.stat().st_size
                if size != info.get("bytes"):
                    raise InputError(f"{self.path}: rank{r}/{name} is truncated or changed: {size} bytes, "
                                     f"{info.get('bytes')} when written")
                files[r].append(f)
        # The ranks of one run write at the same time: one that finished before another
        # started is left over from another run.
        if len(windows) > 1:
            late = max(windows, key=lambda r: windows[r][0])
            early = min(windows, key=lambda r: windows[r][1])
            if windows[late][0] > windows[early][1]:
                raise InputError(f"{self.path}: rank{early} finished writing before rank{late} started: the ranks are "
                                 f"from different runs (a stale rank directory from an earlier dump?); refusing to mix them")
        return files

    def _index_tensors(self, root: Path) -> dict:
        """(rank, unit) -> tensor name -> (file, shape)."""
        from safetensors import safe_open

        index: dict = {}
        for r, fs in self._files.items():
            for f in fs:
                unit = f.name.rsplit(".", 2)[0]
                try:
                    with safe_open(str(f), framework="pt") as h:
                        for k in h.keys():
                            sl = h.get_slice(k)
                            index.setdefault((r, unit), {})[k] = (f, tuple(sl.get_shape()))
                            dt = sl.get_dtype()
                            if dt not in FLOAT_DTYPES:
                                raise InputError(f"{self.path}: rank{r}/{f.name}: tensor {k} is {dt}; dumped activations "
                                                 f"and log-probs must be floats ({', '.join(FLOAT_DTYPES)})")
                except InputError:
                    raise
                except Exception as e:
                    raise InputError(f"{self.path}: rank{r}/{f.name} is not a readable safetensors file ({e})") from None
        n = int(self.manifest["samples"])
        for unit in self.dumped:
            if self.unit_by_name[unit].kind in VISION_KINDS:  # data for the samples with images: `check_trace`
                continue
            for r in range(self.world if self.dumped[unit] != "replicated" else 1):
                have = index.get((r, unit), {})
                missing = [i for i in range(n) if f"out.{i}" not in have]
                if missing:
                    what = "no data" if len(missing) == n else f"no data for sample(s) {', '.join(map(str, missing[:5]))}"
                    raise InputError(f"{self.path}: unit {unit} is listed in the manifest but has {what} (rank {r})")
                gaps = [i for i in range(n) if f"in.{i}" not in have]
                if r == 0 and gaps and len(gaps) < n:  # inputs are optional, but for every sample or none
                    raise InputError(f"{self.path}: unit {unit} has inputs for some samples but not for sample(s) "
                                     f"{', '.join(map(str, gaps[:5]))}: its local error would leave them out")
        lp = index.get((0, "logprobs"), {})
        missing = [i for i in range(n) if f"token.{i}" not in lp]
        if missing:
            raise InputError(f"{self.path}: no token log-probs for sample(s) {', '.join(map(str, missing[:5]))} (rank 0 logprobs)")
        for i, t in enumerate(self.manifest["tokens"]):
            shape = lp[f"token.{i}"][1]
            if shape != (t - 1,):
                raise InputError(f"{self.path}: token log-probs of sample {i} have shape {shape}; a sample of {t} tokens "
                                 f"has {t - 1} (one per token after the first)")
        return index

    def _state_units(self, st, mpath) -> dict[str, str]:
        """The manifest's "states": linear-attention units only, each with its shard kind."""
        if not isinstance(st, dict) or not all(v is None or isinstance(v, dict) for v in st.values()):
            raise InputError(f'{mpath}: states must map each linear-attention unit to {{"shard": ...}}')
        linear = [u.name for u in self.units if u.kind == "attn" and getattr(u, "variant", "") == "linear"]
        out = {}
        for name, info in st.items():
            if name not in linear:
                raise InputError(f"{self.path}: the manifest lists a recurrent state for {name!r}, which is not a "
                                 f"linear-attention unit of {self.arch.name} (those: {', '.join(linear) or 'none'})")
            shard = (info or {}).get("shard", "replicated")
            if shard not in STATE_SHARDS:
                raise InputError(f"{self.path}: state of {name}: shard {shard!r} is not one of {', '.join(STATE_SHARDS)}")
            out[name] = shard
        return out

    def _check_states(self) -> dict[str, dict[int, list[int]]]:
        """Unit -> sample -> the boundaries (token counts) it has a state for. Every sample has
        its final state on every rank that holds one; one shape per unit after merging."""
        toks = self.manifest["tokens"]
        bounds: dict = {}
        for unit, shard in self.states.items():
            ranks = range(self.world if shard == "heads" else 1)
            names = [set(k for k in self._index.get((r, unit), {}) if k.startswith("state.")) for r in ranks]
            missing = [i for i in range(len(toks)) if any(f"state.{i}" not in n for n in names)]
            if missing:
                raise InputError(f"{self.path}: unit {unit} is listed with recurrent states but has none for sample(s) "
                                 f"{', '.join(map(str, missing[:5]))}")
            if any(n != names[0] for n in names):
                raise InputError(f"{self.path}: unit {unit}: the ranks hold states for different points")
            shape = None
            for k in sorted(names[0]):
                parts = k.split(".")
                ok = len(parts) in (2, 3) and all(p.isdigit() for p in parts[1:]) and int(parts[1]) < len(toks)
                if ok and len(parts) == 3:
                    ok = 0 < int(parts[2]) < toks[int(parts[1])]
                    if ok:
                        bounds.setdefault(unit, {}).setdefault(int(parts[1]), []).append(int(parts[2]))
                if not ok:
                    raise InputError(f"{self.path}: unit {unit}: tensor {k} is not state.SAMPLE or state.SAMPLE.TOKENS "
                                     f"(0 < TOKENS < the sample's length) of this dump's samples")
                shapes = [self._index[(r, unit)][k][1] for r in ranks]
                if any(len(x) != 3 or x[1:] != shapes[0][1:] for x in shapes):
                    raise InputError(f"{self.path}: unit {unit} {k}: a state is [heads, k_dim, v_dim] (heads split "
                                     f"over the ranks), got {shapes}")
                merged = (sum(x[0] for x in shapes),) + tuple(shapes[0][1:])
                if shape is not None and merged != shape:
                    raise InputError(f"{self.path}: unit {unit} {k}: state shape {merged}, {shape} elsewhere")
                shape = merged
            bounds.setdefault(unit, {})
            for b in bounds[unit].values():
                b.sort()
        return bounds

    def state(self, unit: str, i: int, tokens: int | None = None) -> torch.Tensor:
        """Unit's recurrent state after sample i (or after its first `tokens` tokens), heads merged."""
        n = self.manifest["tokens"][i]
        name = f"state.{i}" if tokens is None or tokens == n else f"state.{i}.{tokens}"
        if self.states[unit] == "replicated":
            return self._read(0, unit, name)
        return torch.cat([self._read(r, unit, name) for r in range(self.world)], dim=0)

    def check_trace(self, trace) -> None:
        n, toks = int(self.manifest["samples"]), list(self.manifest["tokens"])
        if n != len(trace.samples):
            raise InputError(f"{self.path}: dump has {n} samples, the trace {trace.path} has {len(trace.samples)}")
        for i, s in enumerate(trace.samples):
            if toks[i] != len(s.ids):
                raise InputError(f"{self.path}: dump was written for another trace: sample {i} has {toks[i]} tokens in the "
                                 f"dump, {len(s.ids)} in {trace.path}")
        want = self.manifest.get("trace_sha256")
        if want and want != trace.sha256:
            raise InputError(f"{self.path}: dump was written for another trace (trace sha256 differs from {trace.path})")
        self._check_vision(trace)
        cfg = self.config.get_text_config()
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or getattr(cfg, "n_routed_experts", None)
        for unit, shard in self.dumped.items():
            kind = self.unit_by_name[unit].kind
            if kind in VISION_KINDS:  # rows are image patches / image tokens, not the trace's tokens
                continue
            width = {"lm_head": cfg.vocab_size, "router": experts, "shared_expert_gate": 1}.get(kind, cfg.hidden_size)
            width_in = cfg.hidden_size
            if kind == "rope":  # MLA's packed query and key rope dims, in and out (numbisect.backends.mla_rope)
                width = width_in = rope_width(cfg)
            if kind in ("out_gate", "out_proj"):  # Gated DeltaNet: value heads * head dim (the gate's input: core and z)
                vd = gate_width(self.config)
                width, width_in = (vd, 2 * vd) if kind == "out_gate" else (cfg.hidden_size, vd)
            if kind == "conv":  # Gated DeltaNet's causal conv: q, k, v channels, in and out
                width = width_in = conv_width(self.config)
            if kind == "gates":  # Gated DeltaNet's (a, b) in, (g, beta) out
                width = width_in = gates_width(self.config)
            for i in range(n):
                rows = toks[i] - (1 if kind == "lm_head" else 0)
                if kind == "indexer":  # the [T, T] mask of keys picked (numbisect.patching.probes.selection.selection_mask)
                    width = toks[i]
                for which in ("out", "in"):
                    shape = self._merged_shape(unit, f"{which}.{i}", shard if which == "out" else "replicated")
                    if shape is None:
                        continue
                    w = width if which == "out" else width_in
                    if len(shape) != 2 or shape[0] != rows or (w is not None and shape[-1] != w):
                        raise InputError(f"{self.path}: {unit} {which}put of sample {i} has shape {shape}"
                                         + (f" after merging {self.world} {shard} shards" if which == "out" and shard != "replicated" else "")
                                         + f"; the manifest's config and tokens give ({rows}, {w})")

    def _check_vision(self, trace) -> None:
        """A vision unit runs for the samples with images only: its data must be there for
        each of them, and for no other sample (that would be another trace)."""
        images = [i for i, s in enumerate(trace.samples) if s.images is not None]
        for unit, shard in self.dumped.items():
            if self.unit_by_name[unit].kind not in VISION_KINDS:
                continue
            for r in range(self.world if shard != "replicated" else 1):
                have = self._index.get((r, unit), {})
                missing = [i for i in images if f"out.{i}" not in have]
                if missing:
                    raise InputError(f"{self.path}: unit {unit} has no data for sample(s) {', '.join(map(str, missing[:5]))}, "
                                     f"which have images (rank {r})")
                extra = [i for i in range(len(trace.samples)) if i not in images and f"out.{i}" in have]
                if extra:
                    raise InputError(f"{self.path}: unit {unit} has data for sample(s) {', '.join(map(str, extra[:5]))}, "
                                     f"which have no images in {trace.path} (rank {r})")
            gaps = [i for i in images if f"in.{i}" not in self._index.get((0, unit), {})]
            if gaps and len(gaps) < len(images):
                raise InputError(f"{self.path}: unit {unit} has inputs for some samples with images but not for sample(s) "
                                 f"{', '.join(map(str, gaps[:5]))}: its local error would leave them out")

    def _merged_shape(self, unit, name, shard):
        shapes = [self._index.get((r, unit), {}).get(name, (None, None))[1] for r in range(self.world if shard != "replicated" else 1)]
        if shapes[0] is None:
            return None
        if shard == "column":
            if any(s is None or s[:-1] != shapes[0][:-1] for s in shapes):
                raise InputError(f"{self.path}: {unit} {name}: column shards disagree on their leading dims: {shapes}")
            return shapes[0][:-1] + (sum(s[-1] for s in shapes),)
        if shard == "row" and any(s != shapes[0] for s in shapes):
            raise InputError(f"{self.path}: {unit} {name}: row shards (partial sums) differ in shape: {shapes}")
        return shapes[0]

    # -- reading ---------------------------------------------------------------------------------
    def _read(self, r: int, unit: str, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f, _ = self._index[(r, unit)][name]
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(name)

    def tensor(self, unit: str, name: str) -> torch.Tensor | None:
        shard = self.dumped[unit] if name.startswith("out.") else "replicated"
        if name not in self._index.get((0, unit), {}):
            return None
        if shard == "replicated":
            return self._read(0, unit, name)
        parts = [self._read(r, unit, name) for r in range(self.world)]
        if shard == "column":
            return torch.cat(parts, dim=-1)
        total = parts[0].float()
        for p in parts[1:]:
            total = total + p.float()
        return total.to(parts[0].dtype)

    def sample(self, i: int, units=None, inputs=None) -> dict:
        """Sample i: token log-probs, full log-probs (when lm_head was dumped), outputs, inputs."""
        lp = self._read(0, "logprobs", f"token.{i}").float()
        outs = {u: self.tensor(u, f"out.{i}") for u in (units if units is not None else self.dumped) if u in self.dumped}
        ins = {}
        for u in inputs if inputs is not None else self.dumped:
            if u in self.dumped:
                t = self.tensor(u, f"in.{i}")
                if t is not None:
                    ins[u] = t
        full = None
        if "lm_head" in self.dumped:
            logits = outs.get("lm_head")
            if logits is None:
                logits = self.tensor("lm_head", f"out.{i}")
            full = torch.log_softmax(logits.float(), dim=-1)
        return {"token_logprobs": lp, "full_logprobs": full, "outputs": outs, "inputs": ins}

    @property
    def root(self):
        raise InputError("a dump engine has no modules: it can be compared, not swapped")

    def plant_fault(self, fault, ledger) -> None:
        raise self.lacks(f"plant faults (it replays what an engine wrote): {fault.spec or fault.kind}")

    def describe(self) -> dict:
        return {"backend": "dump", "path": self.path, "dtype": self.dtype_name, "arch": self.arch.name,
                "options": {"world_size": self.world, "units": len(self.dumped), "tp_shards": {
                    k: v for k, v in self.dumped.items() if v != "replicated"}}}


def write_dump(backend: Backend, trace, root: str, units=None, world_size: int = 1, shards: dict | None = None,
               max_buffer_mb: float = 256.0, states: bool = True, state_shards: dict | None = None) -> None:
    """Run `backend` (vllm: or hf:) over `trace` and write its activations as a dump.

    Every unit's output and (where it has one) input, and the token log-probs. With
    `world_size` > 1 the tensors of the units in `shards` are split the way a tensor-
    parallel engine holds them ("column": slices of the last dim; "row": partial sums
    that add up to the output), one rank directory each. With `states` (and a model
    with linear attention), each linear unit's recurrent state after every sample and at
    its chunk boundaries (numbisect.pipeline.recurrent's points: one more forward each), rank 0;
    a unit that `state_shards` marks "heads" has its heads split over the ranks in order
    (as a tensor-parallel engine holds them).
    """
    shards = shards or {}
    names = list(units) if units is not None else [u.name for u in backend.units]
    # the units that can be teacher-forced: their inputs are what a dump engine feeds the reference
    feed = [n for n in local_feed_names(backend) if n in names]
    toks = [len(s.ids) for s in trace.samples]
    writers = [DumpWriter(root, str(Path(backend.path) / "config.json"), len(toks), toks, rank=r, world_size=world_size,
                          dtype=backend.dtype_name, trace_sha256=trace.sha256, max_buffer_mb=max_buffer_mb)
               for r in range(world_size)]
    for w in writers:
        for n in names:
            w.declare(n, shards.get(n, "replicated"))
    probe = RS.StateProbe(backend) if states else None
    undo = probe.install() if probe is not None and probe.units else None
    try:
        for i, s in enumerate(trace.samples):
            _write_sample(backend, writers, i, s, names, feed, shards, world_size)
            if undo is None:
                continue
            _write_states(writers, i, probe.take(), None, state_shards or {})
            for L in (RS.boundaries(len(s.ids)) if s.images is None else []):
                backend.forward([RS.prefix(s, L)])
                _write_states(writers, i, probe.take(), L, state_shards or {})
    finally:
        if undo is not None:
            undo()
    for w in writers:
        w.close()


def _write_sample(backend, writers, i, s, names, feed, shards, world_size) -> None:
    """Sample i's forward: its log-probs, and each unit's output and input, split over the ranks."""
    res = backend.forward([s], capture=names, capture_inputs=feed)
    writers[0].logprobs(i, res.token_logprobs[0])
    for n in names:
        if not res.captures.get(n):  # a vision unit on a sample without images
            continue
        out = res.captures[n][0]
        inp = res.inputs[n][0] if res.inputs.get(n) else None
        parts = _split(out, shards.get(n, "replicated"), world_size)
        for r, w in enumerate(writers):
            if r == 0 or shards.get(n, "replicated") != "replicated":
                w.add(n, i, out=parts[r], inp=inp if r == 0 else None)


def _write_states(writers, i, states: dict, tokens, state_shards: dict) -> None:
    for u, st in states.items():
        if state_shards.get(u, "replicated") == "heads":
            for w, part in zip(writers, torch.tensor_split(st, len(writers), dim=0)):
                w.state(u, i, part, tokens=tokens, shard="heads")
        else:  # rank 0 holds it; every rank's manifest lists it
            writers[0].state(u, i, st, tokens=tokens)
            for w in writers[1:]:
                w.declare_state(u)


def _split(t: torch.Tensor, shard: str, world: int) -> list[torch.Tensor]:
    if shard == "column":
        return list(torch.tensor_split(t, world, dim=-1))
    if shard == "row":  # partial sums: rank r holds the contribution of its slice of the hidden units
        mask = torch.arange(t.shape[-1]) % world
        return [torch.where(mask == r, t, torch.zeros_like(t)) for r in range(world)]
    return [t] * world
