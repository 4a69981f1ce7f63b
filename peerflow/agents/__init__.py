"""Multi-turn agent rollouts: environments, tools, and the token-in/token-out driver."""

from peerflow.agents.environment import Environment, StepResult, Turn

__all__ = ["Environment", "StepResult", "Turn"]
