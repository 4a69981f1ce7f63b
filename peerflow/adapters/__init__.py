"""First-party engine adapters, one subpackage each; each imports its engine lazily."""
