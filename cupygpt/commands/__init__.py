"""The commands besides training: verify, bench (+ bench_comm), eval, sample, convert,
prepare (+ corpus), plot, timeline."""
