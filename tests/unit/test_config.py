import pytest

from peerflow.config import load_config, validate_config
from peerflow.config.structure import apply_override
from peerflow.errors import ConfigError
from tests.helpers.configs import validation_error


def test_overrides_are_typed_by_field():
    config = load_config(None, ["trainer.lr=1e-3", "rollout.sampling.n=4",
                                "trainer.bf16=true", "rollout.sampling.stop=[';', 'x']",
                                "trainer.betas=[0.9, 0.95]"])
    assert config.trainer.lr == pytest.approx(1e-3) and isinstance(config.trainer.lr, float)
    assert config.rollout.sampling.n == 4
    assert config.trainer.bf16 is True
    assert config.rollout.sampling.stop == [";", "x"]
    assert config.trainer.betas == (0.9, 0.95)


@pytest.mark.parametrize("override, expected", [
    ("trainer.lrr=1", "trainer.lrr: unknown key. Did you mean 'lr'?"),
    ("rollout.sampling.temprature=1", "Did you mean 'temperature'?"),
    ("runtime.mode=asink", "Did you mean 'async'?"),
    ("rollout.sampling.n=many", "rollout.sampling.n: expected an integer, got 'many'"),
])
def test_bad_values_name_the_key_and_the_fix(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("?", r"\?").replace("[", r"\[")):
        load_config(None, [override])


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_override({}, "trainer.lr")


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  lr: 0.5\nrollout:\n  backend: hf\n")
    config = load_config(path, ["trainer.lr=0.25"])
    assert config.trainer.lr == 0.25


def test_unknown_backend_lists_installed_backends(plugin_manager):
    message = validation_error(plugin_manager, "rollout.backend=nosuch")
    assert "unknown rollout backend 'nosuch'" in message
    assert "hf" in message and "vllm" in message and "sglang" in message


def test_adapter_options_validated_only_when_selected(plugin_manager):
    # A typo inside an unselected backend's section is not checked …
    config = load_config(None, ["rollout.vllm.not_an_option=1"])
    validate_config(config, plugin_manager)
    # … but the selected backend's section is validated by its options class.
    message = validation_error(plugin_manager, "rollout.hf.not_an_option=1")
    assert "rollout.hf.not_an_option: unknown key" in message


def test_section_that_is_no_backend_gets_did_you_mean(plugin_manager):
    message = validation_error(plugin_manager, "rollout.samplng.n=2")
    assert "rollout.samplng: unknown key. Did you mean 'sampling'?" in message


def test_async_settings_are_checked_before_any_process_starts(plugin_manager):
    message = validation_error(plugin_manager, "runtime.mode=async")
    assert "runtime.mode=async needs runtime.placement=split" in message
