"""One module per verb's orchestration, called by the CLI with typed arguments: `run`
(self-check, search, what-ifs; `run_report` on directories), `compare`, `weights` (through
the live API's `attach`, handed in), `replay` (a replay bundle's compare), `selftest`,
`calibrate`, `conditions`."""
