"""llama.cpp behind a small protocol: the model wrapper and its settings, backends by name, the model's facts,
the numerics it computes with, the crash probe and this CPU's build flags."""
