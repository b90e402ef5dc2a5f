"""Engine-neutral changes a backend carries out on a live model, each undone through one
`Ledger`: planted faults, swaps, prefix reuse, and the probes that record (or replay) routing,
sparse-attention selection and recurrent state during a forward. `arrangement.py` applies
them together for one forward."""
