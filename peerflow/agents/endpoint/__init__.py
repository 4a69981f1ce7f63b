"""The policy endpoint: the current policy as an OpenAI-compatible HTTP service.

During a run whose `rollout.agent.environment` is `agent-program`, each rollout process
serves `/v1/chat/completions`, `/v1/completions`, `/v1/models` and vLLM's token-in
`/inference/v1/generate` (`server`), bound to 127.0.0.1 with a per-run bearer token. Agent
programs written against an OpenAI client call it (`program`); every call is answered by
the one agent driver (`peerflow.agents.rollout`) with the engine's own tokens, log-probs
and weight versions, and recorded token-exactly as the trajectory the trainer trains on.
`protocol` holds the request and response shapes, validated at the edge against
`limits`; `serving` starts the servers a run owns (this one, OpenEnv's) with their bearer
token and connection limits.
"""
