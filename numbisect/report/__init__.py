"""The report: the versioned JSON document (`document.py`, with its schema), the one view every
reader takes of it (`view.py`), the text summary (`summary.py`), Markdown and diff (`tools.py`)
and one renderer per section (`sections/`). Torch-free: `bisect report` runs without the models."""
