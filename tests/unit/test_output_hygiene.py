"""Model text cannot drive the terminal, and `peerflow report` cannot be aimed at a file.

The attacks of issue 49 (item 7): a response holding escape sequences (clear the screen,
write the clipboard with OSC 52, a C1 CSI, a bidirectional override) shown by `peerflow
samples`; symbolic links planted in `RUN_DIR/report/` before `peerflow report` runs.
"""

from __future__ import annotations

import json
import os

import pytest

from peerflow.cli import main
from peerflow.outputs import MetricsWriter
from peerflow.outputs.report import render_report
from peerflow.outputs.samples import write_samples
from peerflow.outputs.terminal import escape_control, escape_json

#: Clear screen, home, an OSC 52 clipboard write (BEL-terminated), a C1 CSI colour, a
#: carriage return that would overwrite the line, DEL, a right-to-left override, a NUL.
HOSTILE = ("\x1b[2J\x1b[Hok\x1b]52;c;cm0gLXJmIH4K\x07 \x9b31mred\x0dhidden\x7f "
           "\u202eevil\x00 end")
#: What no terminal-bound output may contain.
RAW = ("\x1b", "\x07", "\x9b", "\r", "\x7f", "\u202e", "\x00")


def test_escape_control_shows_every_control_and_keeps_text():
    shown = escape_control(HOSTILE + "\n\tcafé 日本 ✓")
    assert not any(c in shown for c in RAW)
    assert shown == (r"\x1b[2J\x1b[Hok\x1b]52;c;cm0gLXJmIH4K\x07 \x9b31mred\x0dhidden\x7f "
                     r"\u202eevil\x00 end" "\n\tcafé 日本 ✓")
    assert escape_control("\ud800") == r"\ud800"  # a lone surrogate cannot even be printed
    assert escape_control(3) == "3"


def test_escape_json_decodes_to_the_same_value():
    value = {"response": HOSTILE + "\ud800", "reward": 1.0, "é": "✓"}
    line = escape_json(value)
    assert not any(c in line for c in RAW) and "\ud800" not in line and "✓" in line
    assert json.loads(line) == value


@pytest.fixture
def hostile_run(tmp_path):
    write_samples(tmp_path, 1, [{"step": 1, "sample_id": 0, "group_id": 0,
                                 "prompt": "say hi" + HOSTILE, "response": HOSTILE,
                                 "reward": 1.0, "components": {"acc": 1.0},
                                 "finish_reason": "stop\x1b[8m", "response_tokens": 9}])
    return tmp_path


def test_samples_panels_show_escape_sequences_instead_of_obeying_them(hostile_run, capsys):
    assert main(["samples", str(hostile_run)]) == 0
    out = capsys.readouterr().out
    assert "step 1: 1 sample" in out
    assert not any(c in out for c in RAW), [c for c in RAW if c in out]
    assert r"\x1b]52;c;cm0gLXJmIH4K" in out and r"stop\x1b[8m" in out


def test_samples_json_lines_escape_them_and_decode_unchanged(hostile_run, capsys):
    assert main(["samples", str(hostile_run), "--json"]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in RAW)
    assert json.loads(out)["response"] == HOSTILE


def test_an_error_line_quoting_model_text_is_escaped(tmp_path, capsys):
    assert main(["samples", str(tmp_path / "no\x1b[2Jrun")]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and r"no\x1b[2Jrun" in err


def _metrics(run_dir) -> None:
    with MetricsWriter(run_dir, tensorboard=False) as writer:
        for step in range(1, 4):
            writer(step, {"reward/mean": step / 3, "kl/mean": 0.01 * step})


def test_report_replaces_planted_symlinks_and_leaves_their_targets(tmp_path):
    run_dir, victim_dir = tmp_path / "run", tmp_path / "outside"
    victim_dir.mkdir()
    _metrics(run_dir)
    (run_dir / "report").mkdir()
    victims = {}
    for name in ("reward.png", "kl.png", "summary.json"):
        victim = victim_dir / name
        victim.write_text(f"precious {name}")
        (run_dir / "report" / name).symlink_to(victim)
        victims[name] = victim
    files = render_report(run_dir)
    for name, victim in victims.items():
        assert victim.read_text() == f"precious {name}"
        written = run_dir / "report" / name
        assert written in files and written.is_file() and not written.is_symlink()
    assert (run_dir / "report" / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((run_dir / "report" / "summary.json").read_text())["steps"] == 3
    assert not [p for p in (run_dir / "report").iterdir() if p.name.startswith(".")]


def test_report_refuses_a_report_folder_that_is_a_symlink(tmp_path, capsys):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _metrics(run_dir)
    os.symlink(elsewhere, run_dir / "report")
    assert main(["report", str(run_dir)]) == 1
    assert "is a symbolic link" in capsys.readouterr().err
    assert not list(elsewhere.iterdir())
    assert main(["report", str(run_dir), "--out", str(tmp_path / "chosen")]) == 0
    assert (tmp_path / "chosen" / "reward.png").is_file()
