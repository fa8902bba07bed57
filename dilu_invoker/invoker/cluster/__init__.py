"""The invoker's cluster agent: routing activations to instances (here or forwarded), instance commands, load
reports, the function registry and streams — sharing one :class:`~dilu_invoker.invoker.cluster.agent.Agent`."""
