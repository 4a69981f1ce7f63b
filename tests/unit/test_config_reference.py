"""`docs/config.md` is generated from the config classes and checked against them."""

from __future__ import annotations

from pathlib import Path

from peerflow.config.reference import render, undocumented

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_docs_config_md_is_the_generated_reference(plugin_manager):
    assert DOC.read_text() == render(plugin_manager), (
        "docs/config.md is out of date with the config classes; regenerate it: "
        "peerflow config reference > docs/config.md"
    )


def test_every_config_field_has_a_docstring(plugin_manager):
    missing = undocumented(plugin_manager)
    assert not missing, f"config fields without a docstring under them: {missing}"


def test_reference_lists_defaults_and_engine_sections(plugin_manager):
    text = render(plugin_manager)
    assert "| `trainer.lr` | `float` | `1e-06` |" in text
    assert "| `trainer.bf16` | `bool \\| Literal['auto']` | `auto` |" in text
    for section in ("## `trainer.fsdp`", "## `trainer.deepspeed`", "## `rollout.vllm`",
                    "## `task.options (task.name: dataset)`", "## `algorithm.options.grpo`"):
        assert section in text
