"""An example third-party PeerFlow plugin: a rollout engine, a reward and an estimator."""
