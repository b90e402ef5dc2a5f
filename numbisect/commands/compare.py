"""`bisect compare`: one comparison of the engine with the reference, as a report.

1. `Session.open` reads and checks the inputs the `Spec` names, then loads both sides.
2. `Session.compare` runs the comparison pipeline (numbisect.pipeline.comparison): token
   metrics, RL cost, per-unit propagated and local error.
3. With `replay_indexer`, the sparse-attention indexer replay what-if
   (numbisect.pipeline.selection) adds `indexer_replay` to the body (`indexer_replay`,
   also run after a search by `bisect run`).
4. `new_report` (numbisect.pipeline.provenance) puts the envelope around the body.
"""

from __future__ import annotations

from numbisect.pipeline.measure import Settings
from numbisect.pipeline.provenance import new_report
from numbisect.pipeline.selection import replay_whatif
from numbisect.session.session import Session, Spec


def compare(spec: Spec, settings: Settings, *, local: bool = True, replay_indexer: bool = False, argv: list[str],
            progress=None) -> dict:
    """The report of kind "compare" (`argv`: the command line it records); the backends the
    session opened are closed before it returns."""
    session = Session.open(spec, settings, progress=progress)
    try:
        body = session.compare(local=local)
        if replay_indexer:
            indexer_replay(session, body)
        return new_report("compare", argv, session.inputs(), settings.to_dict(), body)
    finally:
        session.close()


def indexer_replay(session: Session, body: dict) -> None:
    """The indexer replay what-if (numbisect.pipeline.selection) into the report body as `indexer_replay`."""
    replay = replay_whatif(session.sides())
    if replay is not None:
        body["indexer_replay"] = replay
