"""An example third-party PeerFlow plugin: one reward and one advantage estimator."""
