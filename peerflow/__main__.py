"""`python -m peerflow …` is the `peerflow` command (used by `torchrun -m peerflow`)."""

from peerflow.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
