"""The routing probe on a transformers engine: a forward hook on each router (`mlp.gate`
returns logits, weights and expert ids); the probe records the ids and may replace them
(numbisect.patching.probes.routing.RoutingProbe.route)."""

from __future__ import annotations

from numbisect.patching.ledger import Ledger


def install_probe(engine, probe, ledger: Ledger) -> None:
    for unit in probe.units:
        calls = [0]

        def hook(m, args, out, unit=unit, calls=calls):
            logits, w, ids = out[0], out[1], out[2]
            w2, ids2 = probe.route(unit, calls[0], logits, w, ids)
            calls[0] += 1
            return (logits, w2, ids2) + tuple(out[3:])

        ledger.hooks(engine.module(unit), post=hook, with_kwargs=False)
