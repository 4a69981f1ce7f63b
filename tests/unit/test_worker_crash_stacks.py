"""A worker that crashes in native code prints every thread's Python stack."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

_CRASH = textwrap.dedent("""
    import os, threading, time
    from peerflow.worker.main import _dump_stacks_on_crash

    _dump_stacks_on_crash()

    def receiving_weights():
        time.sleep(60)

    threading.Thread(target=receiving_weights, daemon=True).start()
    time.sleep(0.2)
    os.abort()  # what a C++ std::terminate does
""")


def test_an_abort_prints_the_stack_of_every_thread():
    result = subprocess.run([sys.executable, "-c", _CRASH], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in result.stderr
    assert "in receiving_weights" in result.stderr  # the other thread, not only the main one
