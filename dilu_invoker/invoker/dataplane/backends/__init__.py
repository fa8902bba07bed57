"""Container backends: where an action's runtime runs (a child process, or a container)."""
