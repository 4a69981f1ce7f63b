from __future__ import annotations

import json
import types

import pytest

from peerflow.config import load_config, validate_config
from peerflow.errors import ConfigError
from peerflow.planner.validate import validate_workflow
from peerflow.plugins import get_plugin_manager, hookimpl
from peerflow.plugins.manager import PluginManager
from peerflow.workflow import (
    BUILTIN_KINDS,
    Node,
    NodeType,
    WorkflowGraph,
    build_graph,
    grpo_graph,
    ppo_graph,
)


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_grpo_and_ppo_graphs_order_and_edges() -> None:
    g = grpo_graph()
    assert g.order() == ("generate", "reward", "old_logprob", "advantage", "train_actor",
                         "sync_weights")
    assert {e.name for e in g.producers("advantage")} == {"generate->advantage",
                                                           "reward->advantage"}
    assert "ref_logprob" in grpo_graph(kl="loss").order()
    assert "ref_logprobs" in grpo_graph(kl="loss").node("train_actor").inputs
    in_reward = grpo_graph(kl="reward")
    assert "ref_logprobs" in in_reward.node("advantage").inputs
    assert "ref_logprobs" not in in_reward.node("train_actor").inputs
    assert "ref_logprobs" in ppo_graph(kl="reward").node("advantage").inputs
    p = ppo_graph()
    order = p.order()
    assert order.index("values") < order.index("advantage") < order.index("train_critic")
    assert p.node("sync_weights").after == ("train_actor",)


def test_default_config_is_grpo_and_kl_adds_reference(tmp_path) -> None:
    config = load_config(None)
    assert config.workflow.graph_name == "grpo"
    assert build_graph(config).order()[0] == "generate"
    config = load_config(None, ["algorithm.kl.coef=0.1"])
    assert "ref_logprob" in build_graph(config).order()
    config = load_config(write(tmp_path, "workflow: {graph: ppo}\n"))
    assert "train_critic" in build_graph(config).order()


def test_yaml_fan_out_and_fan_in(tmp_path) -> None:
    config = load_config(write(tmp_path, """
workflow:
  nodes:
    - {name: generate}
    - {name: fmt, kind: reward, outputs: [format_reward], options: {reward: format}}
    - {name: correct, kind: reward, outputs: [correct_reward]}
    - {name: advantage, inputs: [response_ids, format_reward, correct_reward]}
    - {name: old_logprob}
    - {name: train_actor}
    - {name: sync_weights}
"""))
    graph = build_graph(config)
    into_adv = {e.producer: e.fields for e in graph.producers("advantage")}
    assert into_adv == {"generate": ("response_ids",), "fmt": ("format_reward",),
                        "correct": ("correct_reward",)}
    assert {e.consumer for e in graph.consumers("generate")} >= {"fmt", "correct", "advantage"}
    assert graph.node("sync_weights").after == ("train_actor",)
    assert graph.node("fmt").options == {"reward": "format"}
    order = graph.order()
    assert order.index("fmt") < order.index("advantage")
    assert order.index("correct") < order.index("advantage")


def test_cycle_names_the_nodes() -> None:
    nodes = [Node(name="a", kind="x", role="actor", inputs=["b_out"], outputs=["a_out"]),
             Node(name="b", kind="x", role="actor", inputs=["a_out"], outputs=["b_out"])]
    with pytest.raises(ConfigError, match="cycle through nodes a, b"):
        WorkflowGraph(nodes)


def test_missing_input_names_node_field_and_fix() -> None:
    nodes = [Node(name="train", kind="train_actor", role="actor", inputs=["advantages"])]
    with pytest.raises(ConfigError) as info:
        WorkflowGraph(nodes)
    text = str(info.value)
    assert "'train'" in text and "'advantages'" in text and "add a node" in text


def test_duplicate_outputs_and_names() -> None:
    nodes = [Node(name="r", kind="reward", role="reward", inputs=["prompt_ids"],
                  outputs=["reward"]),
             Node(name="r", kind="reward", role="reward", outputs=["reward"])]
    with pytest.raises(ConfigError, match="defined twice"):
        WorkflowGraph(nodes)


def test_unknown_kind_and_role_in_yaml(tmp_path) -> None:
    config = load_config(write(tmp_path, """
workflow:
  nodes:
    - {name: generate, kind: generat}
    - {name: reward, role: rewarder}
"""))
    with pytest.raises(ConfigError) as info:
        build_graph(config)
    text = str(info.value)
    assert "unknown kind 'generat'" in text and "Did you mean 'generate'" in text
    assert "unknown role 'rewarder'" in text and "Did you mean 'reward'" in text


def test_graph_and_nodes_together_is_an_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="keep `graph`"):
        load_config(write(tmp_path, "workflow: {graph: grpo, nodes: [{name: generate}]}\n"))


def test_unknown_builtin_graph() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'grpo'"):
        build_graph(load_config(None, ["workflow.graph=grp"]))


class Judge(NodeType):
    name = "judge"
    role = "reward"
    inputs = ("response_ids",)
    outputs = ("judge_score",)


def test_plugin_node_type_resolves_defaults(tmp_path) -> None:
    pm = PluginManager()
    plugin = types.SimpleNamespace(
        peerflow_register_nodes=hookimpl(lambda register: register(Judge)))
    pm.register(plugin, "judge-plugin")
    config = load_config(write(tmp_path, """
workflow:
  nodes:
    - {name: generate}
    - {name: judge}
    - {name: advantage, inputs: [judge_score]}
"""))
    graph = build_graph(config, pm)
    assert graph.node("judge").role == "reward"
    assert graph.node("judge").outputs == ("judge_score",)
    with pytest.raises(ConfigError, match="unknown kind 'judge'"):
        build_graph(config)


def test_validator_is_registered_and_reports_everything(tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown role 'actr'"):  # through the hook
        validate_config(load_config(None, ["workflow.nodes=[{name: generate, role: actr}]"]),
                        get_plugin_manager())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"num_attention_heads": 6, "num_key_value_heads": 2, "num_hidden_layers": 2}))
    config = load_config(None, [f"model.path={model}", "runtime.nprocs=4",
                                "rollout.layout.tp=4", "trainer.layout.pp=4"])
    problems = validate_workflow(config, None)
    text = "\n".join(problems)
    assert "tp=4 does not divide the model's 6 attention heads" in text
    assert "node 'generate'" in text and "[1, 2, 3, 6]" in text
    assert "pp=4 exceeds the model's 2 layers" in text
    config = load_config(None, ["model.builder_options={num_attention_heads: 4}",
                                "runtime.nprocs=2", "rollout.layout.tp=2"])
    assert validate_workflow(config, None) == []


def test_validator_catches_impossible_split() -> None:
    config = load_config(None, ["runtime.placement=split", "runtime.nprocs=4",
                                "rollout.layout.dp=2", "trainer.layout.dp=4"])
    (problem,) = validate_workflow(config, None)
    assert "rollout needs 2 ranks and trainer 4" in problem and "--nprocs 6" in problem


def test_validator_catches_cycles_from_yaml(tmp_path) -> None:
    config = load_config(write(tmp_path, """
workflow:
  nodes:
    - {name: generate, inputs: [prompt_ids, reward]}
    - {name: reward}
"""))
    problems = validate_workflow(config, None)
    assert any("cycle" in p for p in problems)


def test_workflow_section_round_trips_through_dump(tmp_path) -> None:
    from peerflow.config import dump_config

    config = load_config(None, ["workflow.nodes=[{name: generate}, {name: reward, outputs: "
                                "[r1]}, {name: advantage, inputs: [r1]}]"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(config))
    again = load_config(path)
    assert again.workflow == config.workflow
    assert build_graph(again).node("advantage").inputs == ("r1",)


def test_builtin_kinds_register_through_pluggy_like_a_plugin(plugin_manager) -> None:
    registry = plugin_manager.registry("node")
    assert set(BUILTIN_KINDS) <= set(registry.names())
    for kind, spec in BUILTIN_KINDS.items():
        cls = registry.get(kind)
        assert issubclass(cls, NodeType) and cls.spec() == spec and cls.phase == spec.phase
        assert registry.entries[kind].distribution == "peerflow"
