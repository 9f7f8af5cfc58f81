"""What is measured on: corpora and their windows, conversations rendered by a chat template with the
assistant's tokens labelled, task sets, and hf: specs resolved on the Hugging Face Hub."""
