"""The multi-controller worker: every process runs its own program, step after step.

`peerflow.worker.main.run_worker` is what the launcher calls in every process; it hands
this rank's schedule (`loop.LockstepSchedule` in sync mode, `async_schedule` in async
mode) to the one run driver (`driver.drive`). Node kinds (`nodes`, `executors`), the
per-rank prompt sampler, metrics aggregation and evaluation live in the modules beside it.
"""
