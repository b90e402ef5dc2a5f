"""Which unit kinds read each config field, from the family's modeling code.

A config difference is only useful when it says what reads the field. A hand list goes
stale and has blind spots (DeepSeek-V3's `rope_interleave`, gpt-oss's `swiglu_alpha`), so
the readers are derived from the transformers code the reference runs:

1. The family's model is built on the meta device (no weights, no forward) and its modules
   walked: each module path belongs to the unit whose module path is its longest prefix (the
   family's arch map), so each module has a unit kind, or `model` when no unit holds it (the
   model-level mask, the decoder stack itself). The model-level rotary embedding counts as
   `attn`: a swapped attention or layer recomputes its cos/sin with the donor's
   (`backends/hf/swap.py`), so a swap carries what it reads. So does the model-level
   attention mask: what the model reads to build it (`MASK_FIELDS`: the fields transformers'
   `masking_utils` helpers read, such as `sliding_window`, and `layer_types`, by which the
   model picks each layer's mask) counts as `attn`, since a swapped attention or layer is
   handed the mask its donor's config gives (`backends/hf/swap.py`'s `MaskSwap`; vLLM's
   adapters build it from the donor's config too).
2. Each module's class source (and its bases in the same family's modeling file) is parsed:
   `config.F`, `self.config.F`, `text_config.F` and `getattr(config, "F")` are reads of F.
   A read inside `self.X = Cls(..., config.F)` is the child X's (`eps=config.rms_norm_eps`
   in a decoder layer is read by its norm); a read in a function the class calls (the
   masking and rotary helpers: `create_sliding_window_causal_mask` reads `sliding_window`)
   is the class's own, two calls deep.
3. `readers(config)` maps field -> sorted unit kinds; a field no code reads by name is
   absent, and the diff shows it as "read by: unknown" (never dropped). In a multimodal
   family a module reads the sub-config it holds (`self.config`: `text_config`,
   `vision_config`), so its reads are keyed `text_config.F` / `vision_config.F` as well.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
from functools import lru_cache

OUTSIDE = "model"  # the kind given to a module no unit holds (numbisect.report.findings.OUTSIDE)
MASK_HELPERS = "transformers.masking_utils"  # the module whose functions build the attention masks
_DEPTH = 2  # how many calls deep a helper function's reads count


def _training_only(name: str) -> bool:
    """Methods and helpers that never run in an inference forward: weight init, losses."""
    return name == "_init_weights" or "loss" in name


def _prune(tree: ast.AST) -> ast.AST:
    """`tree` without its training-only function definitions (`_training_only`)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [n for n in body if not (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _training_only(n.name))]
    return tree


def _is_config(node: ast.AST) -> bool:
    """`config`, `self.config`, `text_config`, `self.text_config`, `cfg`."""
    if isinstance(node, ast.Name):
        return node.id == "cfg" or node.id.endswith("config")
    if isinstance(node, ast.Attribute):
        return node.attr.endswith("config")
    if isinstance(node, ast.Call):  # config.get_text_config()
        return isinstance(node.func, ast.Attribute) and node.func.attr == "get_text_config"
    return False


def _field_reads(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_config(node.value):
            out.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and _is_config(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            out.add(node.args[1].value)
    return out


def _calls(tree: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


@lru_cache(maxsize=None)
def _function_reads(fn, depth: int) -> frozenset[str]:
    """The config fields function `fn` reads, and those of the functions it calls by name
    (`depth` calls deep)."""
    if _training_only(getattr(fn, "__name__", "")):
        return frozenset()
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    out = set(_field_reads(tree))
    if depth > 0:
        g = getattr(fn, "__globals__", {})
        for name in _calls(tree):
            f = g.get(name)
            if isinstance(f, types.FunctionType) and f.__module__.startswith("transformers"):
                out |= _function_reads(f, depth - 1)
    return frozenset(out)


@lru_cache(maxsize=None)
def _class_reads(cls) -> tuple[frozenset[str], tuple[tuple[str, frozenset[str]], ...]]:
    """(fields the class reads itself, ((child attribute, fields read to build it), ...))."""
    own: set[str] = set()
    child: dict[str, set[str]] = {}

    g = vars(sys.modules.get(cls.__module__)) if cls.__module__ in sys.modules else {}
    for klass in cls.__mro__:
        if klass.__module__ != cls.__module__:  # only the family's own modeling code
            continue
        try:
            tree = _prune(ast.parse(textwrap.dedent(inspect.getsource(klass))))
        except (OSError, TypeError, SyntaxError):
            continue
        built = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                t = node.targets[0]
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    reads = _field_reads(node.value)
                    if reads and isinstance(node.value, ast.Call):  # self.X = Cls(..., config.F): X's
                        child.setdefault(t.attr, set()).update(reads)
                        built |= {id(n) for n in ast.walk(node.value)}
        for node in ast.walk(tree):
            if id(node) in built:
                continue
            if isinstance(node, ast.Attribute) and _is_config(node.value):
                own.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                  and len(node.args) >= 2 and _is_config(node.args[0]) and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str)):
                own.add(node.args[1].value)
        for name in _calls(tree):
            f = g.get(name)
            if isinstance(f, types.FunctionType) and f.__module__.startswith("transformers"):
                own |= _function_reads(f, _DEPTH - 1)
    return frozenset(own), tuple((k, frozenset(v)) for k, v in child.items())


@lru_cache(maxsize=None)
def mask_fields() -> frozenset[str]:
    """The config fields the model-level attention mask depends on: those the mask builders of
    transformers' `masking_utils` read (two calls deep: `sliding_window`,
    `attention_chunk_size`, ...), and `layer_types` (each layer's mask is picked by it)."""
    from transformers import masking_utils as helpers
    out = {"layer_types"}
    for f in vars(helpers).values():
        if isinstance(f, types.FunctionType) and f.__module__ == MASK_HELPERS and f.__name__.startswith("create_"):
            out |= _function_reads(f, _DEPTH)
    return frozenset(out)


def _meta_model(arch, config):
    import torch
    import transformers

    auto = getattr(transformers, arch.hf_auto)
    with torch.device("meta"):
        return auto.from_config(config)


def _unit_of(path: str, prefixes: list[tuple[str, str]]) -> str | None:
    """The unit whose module path is the longest prefix of module `path` (`prefixes`:
    (module path, unit), longest first, as `ckptdiff.unit_prefixes` gives them)."""
    for p, unit in prefixes:
        if path == p or path.startswith(p + "."):
            return unit
    return None


def readers(arch, config, prefixes: list[tuple[str, str]]) -> dict[str, list[str]]:
    """Config field -> the unit kinds whose modules read it (`model`: outside every unit),
    derived from the family's transformers modeling code (module docstring). `prefixes`:
    (transformers module path, unit) of every unit, longest first (`ckptdiff.unit_prefixes`)."""
    model = _meta_model(arch, config)
    kind = {u.name: u.kind for u in arch.units(config)}
    modules = dict(model.named_modules())

    try:  # the swaps carry the rotary embedding's reads (module docstring)
        rotary = next(p for p, m in modules.items() if m is arch.rotary(model))
    except Exception:
        rotary = None

    def kind_of(path: str) -> str:
        if rotary is not None and (path == rotary or path.startswith(rotary + ".")):
            return "attn"
        u = _unit_of(path, prefixes) if path else None
        return kind.get(u, OUTSIDE) if u is not None else OUTSIDE

    from transformers import PretrainedConfig

    spaces = {id(v): k for k, v in vars(config).items() if isinstance(v, PretrainedConfig)}  # text_config, vision_config
    space: dict[str, str] = {}
    out: dict[str, set[str]] = {}
    carried = mask_fields()  # read outside every unit to build the mask, which swaps carry
    for path, module in modules.items():  # parents before children
        own_cfg = getattr(module, "config", None)
        ns = spaces.get(id(own_cfg), "") if isinstance(own_cfg, PretrainedConfig) else space.get(path.rpartition(".")[0], "")
        space[path] = ns
        own, children = _class_reads(type(module))
        k = kind_of(path)
        for f in own:
            fk = "attn" if k == OUTSIDE and f in carried else k
            out.setdefault(f, set()).add(fk)
            if ns:
                out.setdefault(f"{ns}.{f}", set()).add(fk)
        for attr, fields in children:
            sub = f"{path}.{attr}" if path else attr
            # a child that is a module (or a list of them): its kind; else the builder's own
            ck = kind_of(sub) if sub in modules and not isinstance(modules[sub], _containers()) else k
            if sub in modules and isinstance(modules[sub], _containers()):
                ck = kind_of(f"{sub}.0") if f"{sub}.0" in modules else k
            for f in fields:
                out.setdefault(f, set()).add(ck)
                if ns:
                    out.setdefault(f"{ns}.{f}", set()).add(ck)
    return {f: sorted(ks) for f, ks in out.items()}


def _containers():
    import torch

    return (torch.nn.ModuleList, torch.nn.ModuleDict)
