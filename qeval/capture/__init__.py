"""Corpus to store: documents and windows, the model's facts, the llama.cpp engine behind a small
protocol, the crash probe and this CPU's build flags, and the capture loop that writes stores."""
