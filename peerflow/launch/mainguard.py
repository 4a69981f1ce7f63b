"""`peerflow.train()` from any script: with or without `if __name__ == "__main__":`.

multiprocessing starts every spawned or fork-server worker by importing the caller's
`__main__` again (its file, or the module of `python -m`); a script that calls
`peerflow.train()` at the top level would start the run again in each worker — a long
multiprocessing traceback and an empty run directory per worker — and one read from
standard input (`python - <<EOF`) has no file to import (`<stdin>`). PeerFlow's workers
need nothing from `__main__` (they run `peerflow.launch.entry.worker_entry` with plain
arguments), so `main_module_hidden` hides it while they start.

A reward function defined in the script itself is different: workers load it from the
script's file, which runs the script's top-level code. `check_main_guard` refuses that
case before anything starts, naming the line to indent under the guard.
"""

from __future__ import annotations

import ast
import contextlib
import sys
import types
from collections.abc import Iterator, Sequence
from pathlib import Path

from peerflow.errors import ConfigError


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Workers started inside this block do not import the caller's `__main__`."""
    main = sys.modules.get("__main__")
    if main is None or not (getattr(main, "__file__", None) or getattr(main, "__spec__", None)):
        yield  # a notebook or `python -c`: nothing would be imported
        return
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _main_script() -> Path | None:
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return Path(path).resolve() if path and Path(path).is_file() else None


def _top_level_line(script: Path) -> int | None:
    """The line of `script`'s top-level statement running now (the outermost frame)."""
    frame = sys._getframe(1)  # noqa: SLF001 - the caller's stack
    line = None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and Path(frame.f_code.co_filename).resolve() \
                == script:
            line = frame.f_lineno
        frame = frame.f_back
    return line


def _guarded(script: Path, line: int) -> bool:
    """Whether `line` of `script` lies inside an `if __name__ == "__main__":` block."""
    try:
        tree = ast.parse(script.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return True  # cannot tell: let the run go
    for node in tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) \
                and "__main__" in ast.unparse(node.test):
            if node.lineno <= line <= (node.end_lineno or node.lineno):
                return True
    return False


def check_main_guard(reward_refs: Sequence[str], call: str = "peerflow.train()") -> None:
    """Refuses a top-level call whose rewards are loaded from the calling script itself.

    Args:
        reward_refs: The run's reward references (`path.py:fn`, `module:fn`, names).
        call: The API call, as the message names it.

    Raises:
        ConfigError: naming the script, the line and what to add.
    """
    script = _main_script()
    if script is None:
        return
    own = [ref for ref in reward_refs if ref.rpartition(":")[0].endswith(".py")
           and Path(ref.rpartition(":")[0]).expanduser().resolve() == script]
    line = _top_level_line(script) if own else None
    if line is None or _guarded(script, line):
        return
    names = ", ".join(ref.rpartition(":")[2] for ref in own)
    raise ConfigError(
        f"{script}:{line}: {call} runs at the top level of the script that defines the "
        f"reward ({names}); every worker loads the reward from that file and would start "
        f"the run again. Put the call under the main guard:\n\n"
        f'    if __name__ == "__main__":\n        {call.replace("()", "(...)")}\n\n'
        "or move the reward into its own module and import it."
    )
