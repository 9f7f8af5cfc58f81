"""The file format: the store (spec: docs/store-format.md), its logit codec, llama-perplexity's
base files, and where stores live."""
