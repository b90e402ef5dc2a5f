"""What a run is about, before anything runs: architecture maps (`arch/`), canonical units and
their graph, the router's selection rule, token traces and rollout formats, token groups,
the user's engine configuration, and the checkpoint diff (and damaged copies for self-tests)."""
