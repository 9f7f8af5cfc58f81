"""Presentation: llama-perplexity-style text and JSON reports, leaderboards (Markdown, HTML, plots)."""
