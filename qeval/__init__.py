"""qeval: measure how much quantization hurts a GGUF language model.

Data flow: corpus -> capture -> store -> metrics -> report.
"""

__version__ = "0.1.0"
