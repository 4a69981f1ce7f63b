"""The disk fills up during the metrics write (issue 36 item 3): the error names the file,
`metrics.jsonl` keeps whole lines only, and since the rank log cannot be written either,
the launcher says where the traceback went instead."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest

from peerflow.outputs import MetricsWriter, read_metrics
from tests.helpers.procs import program_launch

pytestmark = pytest.mark.distributed

PROGRAM = textwrap.dedent('''
    import errno, os, shutil
    from peerflow.distributed import stage
    from peerflow.outputs import MetricsWriter

    def run(config_path, overrides, run_dir, resume):
        logs = os.path.join(run_dir, "logs")  # the rank log cannot be written any more
        shutil.rmtree(logs)
        open(logs, "w").close()
        real = os.write

        def full_disk(fd, data):  # the fault point: the write call, half a line in
            if b'"step": 2' in bytes(data):
                real(fd, bytes(data)[:12])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, data)

        os.write = full_disk
        with MetricsWriter(run_dir, tensorboard=False) as writer, stage("lockstep"):
            writer.write(1, {"reward/mean": 0.5})
            writer.write(2, {"reward/mean": 0.6})
''')

LAUNCHER = textwrap.dedent('''
    import sys
    from peerflow.errors import PeerFlowError
    from peerflow.launch import launch
    try:
        launch(None, [], sys.argv[1], None, nprocs=1, launcher="elastic",
               fault_timeout=10.0, entry="diskprog:run", torch_threads=1)
    except PeerFlowError as exc:
        print("LAUNCHER:", exc, file=sys.stderr)
        sys.exit(1)
''')


def test_a_full_disk_names_the_file_keeps_whole_lines_and_says_where_the_log_is(tmp_path):
    run_dir, env = program_launch(tmp_path, "diskprog", PROGRAM)
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, str(run_dir)], env=env,
                          capture_output=True, text=True, timeout=300)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    report = err[err.index("LAUNCHER:"):]
    metrics = run_dir / "metrics.jsonl"
    assert "No space left on device" in report and str(metrics) in report, report
    assert "could not write its log" in report and "printed above" in report, report
    assert "Traceback (most recent call last)" in err[:err.index("LAUNCHER:")]  # it is
    assert metrics.read_text() == json.dumps({"step": 1, "reward/mean": 0.5}) + "\n"


def test_readers_skip_a_last_line_cut_short_by_an_older_writer(tmp_path, monkeypatch):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(1, {"loss": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as handle:  # what a full disk left before
        handle.write('{"step": 2, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    real = os.write

    def full_disk(fd, data):
        real(fd, bytes(data)[:5])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        monkeypatch.setattr(os, "write", full_disk)
        with pytest.raises(OSError, match="metrics.jsonl"):
            writer.write(2, {"loss": 1.0})
        monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'  # whole or absent
