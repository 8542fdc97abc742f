"""The static GPU model of a d12 bf16 step (docs/measurements.md): a package, so
its modules import one another relatively and never by bare names such as flash or hw on
sys.path. Run its tools from the repository's root: python -m dev.gpumodel.model_h200."""
