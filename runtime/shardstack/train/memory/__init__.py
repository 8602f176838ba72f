"""Memory: the per-rank estimator (`estimate`), `micro_batch: auto` (`autobatch`), host peak RSS (`host`)."""
