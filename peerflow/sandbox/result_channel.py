"""The private stdout of a trusted program that runs untrusted code inside the sandbox.

The `code` reward's harness (`peerflow.rewards.assert_harness`) and the agents' tool runner
(`peerflow.agents.tool_runner`) are constant programs that import or call model-written
code in their own process, then report on stdout. `PRIVATE_STDOUT` is the source they run
before any of that code: it keeps a duplicate of stdout as `out` (the only way to the
host's stdout from then on) and points fds 0 and 1 at `/dev/null` — or, where a sandbox
lets a program write only in its own directory (the audit-hook fallback), at a file there
— so what the untrusted code reads or prints never reaches the host's result stream. The
report lines themselves carry a per-call sentinel, and the host reads only the last one.
"""

#: Source to run first (needs `os` imported); defines `out`.
PRIVATE_STDOUT = r'''
out = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
try:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
except OSError:  # a sandbox that allows writes only in its own directory
    os.dup2(os.open(".untrusted-output", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
'''
