"""dilu-invoker: GPU resourcing-on-demand for Apache OpenWhisk."""

__version__ = "0.1.0"
