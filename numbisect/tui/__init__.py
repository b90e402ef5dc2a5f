"""The Textual TUI (`bisect tui`): the only part of numbisect that imports textual.

`app.BisectApp` holds the state and the live-mode workers; `screens/` the main screen
and dialogs; `widgets/` the panels; `model.py` and `live.py` the computations and the
live run, both free of textual; `messages.py` the typed messages workers post back.
"""
