"""A run that survives stops, crashes and bad states: checkpoints and their manifests, the run folder's
lock, stop signals, the hang watchdog, out-of-memory handling, bit-identical resume (determinism.py)
and the test-only fault hook (faults.py)."""
