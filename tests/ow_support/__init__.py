"""Test doubles and helpers for the OpenWhisk fronts (importable because ``tests/`` is on ``sys.path``)."""
