"""The writers: a model run over the inputs into a logit store (resumable, or live as a candidate), and task
sets scored into a task store."""
