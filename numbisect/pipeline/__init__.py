"""One comparison of a reference and an engine over a trace (`comparison.py`), what it measures
(`measure.py`, `metrics.py`), how it captures units (`capture.py`, `layerstream.py`, `decode.py`),
and the analysis done at comparison time (log-prob contract, routing, selection, recurrent
state, precision what-ifs)."""
