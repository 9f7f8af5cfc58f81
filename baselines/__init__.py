"""Published numbers shipped with qeval (installed as the package qeval.baselines; schema in SCHEMA.md)."""
