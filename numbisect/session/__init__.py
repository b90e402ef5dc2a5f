"""A debugging session: one trace, one reference, one engine and the trials run on them
(`session.py`), the user's own engine configuration (`userengine.py`) and the conditions a
run's numbers depend on (`environment.py`)."""
