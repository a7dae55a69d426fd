"""tfps.bench: benchmarks that print ratios against anchors measured in the same run."""
