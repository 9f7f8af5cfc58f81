"""The shipped conversation suite and its chat templates (installed as the package qeval.corpora.conversations;
see README.md here)."""
