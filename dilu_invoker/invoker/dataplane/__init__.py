"""The invoker's data plane: one container lifecycle, the pool and its pure choices, the backends with their
isolation, the runtime client, metrics — running activations in containers, knowing nothing of the cluster."""
