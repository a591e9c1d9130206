"""Benchmarks (`tinyloop bench`): side-by-side ratios, the dense twin for the peers, plots of the results."""
