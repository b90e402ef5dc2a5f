"""The culprit search over the unit graph: pure and torch-free; it sees unit names and trial
results only."""
