"""The multi-controller worker: every process runs its own program, step after step.

`peerflow.worker.main.run_worker` is what the launcher calls in every process; the step
loop, the node executors, the per-rank prompt sampler, metrics aggregation and
checkpoint/resume orchestration live in the modules next to it.
"""
