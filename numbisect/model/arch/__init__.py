"""Architecture maps: per model family, where each canonical unit lives in each backend.

One file per family, mostly data (like a state-dict name map): `hf` and `vllm` map a
unit pattern to a module path; `{i}` is the layer index. How a module's output is read
into canonical form is set by the unit kind (see `backends.base.READERS`), with
per-family overrides in `hf_readers` / `vllm_readers`.

`base.py` defines `ArchMap` and `RouterSpec` (pure data); each family file builds one
`ArchMap`; this module is the registry (`arch_for`, `supported`), importing the family
files only when first asked.
"""

from __future__ import annotations

from numbisect.common.errors import InputError
from numbisect.model.arch.base import ArchMap, RouterSpec  # noqa: F401  (re-exported: numbisect.model.arch.ArchMap)


def _registry() -> dict[str, ArchMap]:
    from numbisect.model.arch import (  # lazy: import cycle (numbisect.model.arch.qwen3_5_moe imports numbisect.model.arch at load)
        deepseek_v3,
        glm4_moe,
        glm_moe_dsa,
        gpt_oss,
        mixtral,
        olmoe,
        qwen3,
        qwen3_5_moe,
        qwen3_moe,
        qwen3_next,
        qwen3_vl_moe,
    )

    maps = [qwen3_moe.ARCH, qwen3.ARCH, glm4_moe.ARCH, mixtral.ARCH, qwen3_vl_moe.ARCH, olmoe.ARCH, deepseek_v3.ARCH,
            gpt_oss.ARCH, glm_moe_dsa.ARCH, qwen3_5_moe.ARCH, qwen3_next.ARCH]
    return {a: m for m in maps for a in m.architectures}


def supported() -> list[str]:
    return sorted(_registry())


def arch_for(config) -> ArchMap:
    archs = getattr(config, "architectures", None) or []
    archs = [archs] if isinstance(archs, str) else archs
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise InputError(f"config.json: architectures must be a list of class names, got {archs!r}")
    reg = _registry()
    for a in archs:
        if a in reg:
            return reg[a]
    raise InputError(
        f"unsupported architecture {', '.join(archs) or '(none in config.json)'}; "
        f"supported: {', '.join(supported())}"
    )
