"""Probes a backend installs for one forward: expert ids (`routing.py`), an indexer's picked keys
(`selection.py`), linear attention's recurrent state (`state.py`)."""
