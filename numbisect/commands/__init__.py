"""One module per verb's orchestration over a session: `run` (self-check, search, what-ifs),
`selftest`, `calibrate`, `conditions`."""
