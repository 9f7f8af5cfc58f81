"""On top of the stages: saved results, paired comparisons and release gates, baselines, the matrix
plan with its local and Ray executors, store merging and the demo."""
