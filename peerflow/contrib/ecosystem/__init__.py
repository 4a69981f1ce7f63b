"""Tasks and environments from libraries people already use (issue 42).

Each library is an optional extra, checked at `peerflow config validate`:

* `reasoning_gym` — `task.name: reasoning-gym` (`pip install 'peerflow[reasoning-gym]'`);
* `textarena` — `rollout.agent.environment: textarena` (`pip install 'peerflow[textarena]'`).

The modules import their library lazily, so listing the plugins never imports it.
"""
