"""What a run reports: step metrics and MFU, the console / JSON-lines / W&B logger, the W&B history a
resume continues, GPU telemetry (SM clock, power, energy) and the profiler's attention share."""
