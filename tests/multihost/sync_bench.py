"""`peerflow bench weight-sync --split` with the trainer on one simulated host, the rollout
on another, and what each host sends capped by `tc` (issue 43).

    python tests/multihost/sync_bench.py --rate 1gbit --json out.json -- \\
        --shape realistic --init-range 0.02 --runs 20

Needs root and network namespaces (`netns.unavailable()` says why not). The test
`test_weight_sync_delta.py` runs the same launcher on the quickstart shape.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from netns import Hosts

ROOT = Path(__file__).resolve().parents[2]
#: The run secret every host is given (a multi-host run refuses to start without one).
SECRET = "multihost-tests-run-secret-0123456789"


def env() -> dict[str, str]:
    """A host's environment: gloo on the host's `eth0`, one thread, the run secret, no rank
    variables."""
    out = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PEERFLOW_RUN_SECRET=SECRET)
    out["PYTHONPATH"] = f"{ROOT}{os.pathsep}{out.get('PYTHONPATH', '')}"
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        out.pop(key, None)
    return out


def split_bench(hosts: Hosts, bench_args: Sequence[str], json_path: Path, *,
                timeout: float = 3600) -> tuple[dict, list[tuple[int, str]]]:
    """Runs the split bench, rank 0 (trainer) on host 0, rank 1 (rollout) on host 1.

    Returns:
        The bench's JSON (empty when it failed) and each host's (exit code, output).
    """
    procs = []
    for i in range(2):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{hosts.address(0)}:29400", "--rdzv-id", hosts.tag,
                "--local-addr", hosts.address(i), "-m", "peerflow", "bench", "weight-sync",
                "--split", *bench_args, "--json", str(json_path)]
        procs.append(hosts.popen(i, argv, env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True))
    results = [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]
    ok = [code for code, _ in results] == [0, 0] and json_path.is_file()
    return (json.loads(json_path.read_text()) if ok else {}), results


def main() -> int:
    """Creates two hosts, caps their links, runs the bench, prints its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="", help="tc rate of each host's link, e.g. 1gbit")
    parser.add_argument("--json", required=True, help="where the bench writes its JSON")
    parser.add_argument("bench_args", nargs="*", help="after --: the bench's options")
    args = parser.parse_args()
    hosts = Hosts.create(2)
    try:
        for i in range(2 if args.rate else 0):  # either host may get the trainer's rank
            if reason := hosts.limit_rate(i, args.rate):
                raise SystemExit(f"cannot rate-limit the link: {reason}")
        got, results = split_bench(hosts, args.bench_args, Path(args.json).resolve())
    finally:
        hosts.destroy()
    if not got:
        print("\n".join(out for _, out in results))
        return 1
    got["link_rate"] = args.rate or "unlimited"
    Path(args.json).write_text(json.dumps(got, indent=2) + "\n")
    print(json.dumps(got, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
