"""The commands besides training: verify, bench, convert, prepare, plot, timeline."""
