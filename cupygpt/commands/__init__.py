"""The commands besides training: verify, bench, convert, prepare, gpucheck, plot, timeline."""
