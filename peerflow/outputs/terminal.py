r"""Model text made safe for a terminal: the one escaper every print of it goes through.

A model's response, a prompt from a dataset, or a program's output can hold bytes a
terminal obeys rather than shows: `ESC [ 2 J` clears the screen, `ESC ] 52 ; c ; …`
writes the clipboard, `\r` overwrites a line, a C1 `CSI` (U+009B) starts a sequence
without an ESC, and bidirectional overrides (U+202E) reorder what is shown. RL searches
whatever scores; text that hides itself from the person reading samples is one more
target. So model text reaches a terminal only through `escape_control`, which writes each
such character as its Python escape (`\x1b`, `\u202e`) and keeps newlines and tabs;
`escape_json` does the same for a JSON line (as JSON escapes, so the value it decodes to
is unchanged). Used by `peerflow samples` (panels and `--json`) and by the CLI's error
line (a reward's error message can quote the program it ran).
"""

from __future__ import annotations

import json
import re
from typing import Any

#: C0 controls but `\n` and `\t`, DEL, C1 controls, bidirectional marks, embeddings,
#: overrides and isolates, line and paragraph separators, and lone surrogates (which a
#: UTF-8 terminal cannot even be sent).
UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e"
                    "\u2066-\u2069\ud800-\udfff]")


def _python_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def escape_control(text: Any) -> str:
    r"""`text` (made a `str`) with every control character written as its escape.

    `"\x1b[2Jhi\n"` becomes `"\\x1b[2Jhi\n"`: the sequence is shown, not obeyed;
    newlines and tabs stay.
    """
    return UNSAFE.sub(_python_escape, str(text))


def escape_json(value: Any) -> str:
    r"""`value` as one JSON line (non-ASCII text kept) with control characters escaped.

    `json.dumps` already escapes C0 controls; DEL, C1, bidirectional controls and lone
    surrogates become `\uXXXX` too, so `json.loads` of the line gives `value` back.
    """
    return UNSAFE.sub(_json_escape, json.dumps(value, ensure_ascii=False))
