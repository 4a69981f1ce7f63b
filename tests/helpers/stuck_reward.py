"""A reward that never returns on one rank, for tests of failures and stops.

`python -m tests.helpers.stuck_reward CONFIG RUN_DIR OVERRIDE...` launches the config on 2
processes with this module's `run` as the worker entry (select the reward with
`task.reward=stuck`), printing `LAUNCHER: <error>` and exiting 130 (interrupted) or 1 when
the run fails. Environment: `STUCK_RANK` (default 1) hangs in its
`STUCK_CALL`-th reward call (default 1); `STUCK_FLAG`, when set, is a file created just
before it hangs, and `STUCK_FLAG.rank{N}` one created when rank N, not stuck, returns from
that call (it then goes on to wait for the stuck rank in a collective). With
`STUCK_SECONDS` set, the call is only slow: it returns after that many seconds.
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

from peerflow.algorithms.base import RewardFunction
from peerflow.errors import INTERRUPTED_EXIT, PeerFlowError, RunInterruptedError
from peerflow.plugins import get_plugin_manager
from peerflow.worker.main import run_worker
from tests.helpers.plugins import registering


class StuckReward(RewardFunction):
    name = "stuck"
    calls = 0

    def score(self, responses, examples):
        StuckReward.calls += 1
        flag = os.environ.get("STUCK_FLAG")
        if StuckReward.calls != int(os.environ.get("STUCK_CALL", "1")):
            return [0.0] * len(responses)
        if dist.get_rank() == int(os.environ.get("STUCK_RANK", "1")):
            if flag:
                open(flag, "w").close()
            if os.environ.get("STUCK_SECONDS"):  # a slow reward: a live, busy peer
                time.sleep(float(os.environ["STUCK_SECONDS"]))
                return [0.0] * len(responses)
            while True:  # a reward that never returns
                time.sleep(0.1)
        if flag:
            open(f"{flag}.rank{dist.get_rank()}", "w").close()
        return [0.0] * len(responses)


def run(config_path, overrides, run_dir, resume):
    """The worker entry: registers `StuckReward`, then runs the worker."""
    get_plugin_manager().register(registering("peerflow_register_rewards", StuckReward),
                                  "stuck-reward")
    run_worker(config_path, overrides, run_dir, resume)


if __name__ == "__main__":
    from peerflow.launch import launch

    try:
        launch(sys.argv[1], sys.argv[3:], sys.argv[2], None, nprocs=2,
               entry="tests.helpers.stuck_reward:run")
    except PeerFlowError as exc:
        print("LAUNCHER:", exc, file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT if isinstance(exc, RunInterruptedError) else 1)
