"""The training program: the loop, checkpoints, the run directory, the loader, sampling,
HellaSwag evaluation and the outlier gate."""
