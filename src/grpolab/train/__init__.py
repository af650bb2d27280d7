"""Training: the loop (loop.py), one step (step.py), the preflight that gates it, checkpoints,
monitors, the run directory, tracking, the run's setup and the held-out evaluation."""
