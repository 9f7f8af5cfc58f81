"""Evaluation corpora shipped with qeval (installed as the package qeval.corpora)."""
