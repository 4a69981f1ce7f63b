"""A new role is an entry in the role vocabulary: a frozen second model joins the graph.

Issue 50: adding a role (a teacher, a reward model) must be adding an entry to
`peerflow.workflow.roles.ROLES`, not a branch in the worker. This test adds a `teacher`
role — a frozen train engine of its own — and a plugin node that scores every answer
with it, through the same `NodeContext` the built-in kinds get, in a real run.
"""

from __future__ import annotations

import pytest
import torch

from peerflow.worker.main import run_worker
from peerflow.workflow import NodeType
from peerflow.workflow.roles import ROLES, Role, engine_roles, trainable_roles
from tests.helpers.plugins import registering

ENGINES: dict[int, int] = {}
"""id of the teacher engine each step saw → step (one engine for the whole run)."""


class TeacherLogprob(NodeType):
    """The teacher's log-prob of every answer token, and its gap to the actor's."""

    name = "teacher_logprob"
    role = "teacher"
    inputs = ("response_ids", "old_logprobs")
    outputs = ("teacher_logprobs",)

    def run(self, batch, context):
        teacher = context.engine("teacher")
        assert teacher is not context.engine("actor")
        ENGINES[id(teacher)] = context.step
        logprobs = teacher.forward_logprobs(batch)
        gap = (logprobs.values - batch.ragged("old_logprobs").values).abs()
        context.metrics.max("teacher/gap_to_actor", float(gap.max()))
        context.metrics.mean("teacher/logprob_mean", float(logprobs.values.mean()),
                             logprobs.values.numel())
        assert context.process_group("teacher") is not None
        return {"teacher_logprobs": logprobs}


NODES = ("[{name: generate}, {name: reward}, {name: old_logprob}, "
         "{name: teacher, kind: teacher_logprob}, {name: advantage}, {name: train_actor}, "
         "{name: sync_weights}]")


def test_a_frozen_second_model_joins_through_the_role_vocabulary_alone(
        tmp_path, monkeypatch, plugin_manager, quickstart, tiny, metrics_of):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setitem(ROLES, "teacher", Role(name="teacher", side="trainer",
                                               engine="train_engine"))
    assert "teacher" in engine_roles() and "teacher" not in trainable_roles()
    plugin_manager.register(registering("peerflow_register_nodes", TeacherLogprob),
                            "teacher-plugin")
    ENGINES.clear()
    run_dir = tmp_path / "run"
    run_worker(quickstart, [*tiny, "runtime.nprocs=1", "run.steps=3",
                            "rollout.sampling.temperature=0.7", "workflow.graph=null",
                            f"workflow.nodes={NODES}"],
               str(run_dir))
    lines = metrics_of(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert len(ENGINES) == 1  # one teacher engine, built once
    # step 1: the actor has not moved yet, so the teacher (the same checkpoint) agrees
    assert lines[0]["teacher/gap_to_actor"] < 1e-4
    # the actor trains, the teacher stays frozen: they drift apart
    assert lines[-1]["teacher/gap_to_actor"] > 1e-3
    assert all(torch.isfinite(torch.tensor(m["teacher/logprob_mean"])) for m in lines)
    assert all(m["actor/grad_norm"] > 0 for m in lines)


@pytest.fixture(autouse=True)
def _forget_engines():
    yield
    ENGINES.clear()
