"""Optional first-party plugins that are not engines: tasks, rewards, datasets, recipes."""
