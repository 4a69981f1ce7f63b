"""First-party agent environments (registered by `peerflow.contrib.tasks.plugin`)."""
