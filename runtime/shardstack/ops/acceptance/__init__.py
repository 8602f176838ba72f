"""`shardstack acceptance`: the deployment guides' acceptance on a deployed cluster, measured with the cluster's own
verbs and judged against stated thresholds.

The runs are ordinary jobs (`train.submit`, `train.wait_job`) of a small model on the shipped corpus, each writing
the trainer's per-step JSON records (`metrics.json_log`, one line per step) to a directory of this acceptance on
shared storage (`<shared>/checkpoints/acceptance-<UTC time>/`), which is where every figure here comes
from:

- loss: the same job, seed and data at the largest node count with ZeRO stage 0 (partitioning off) and stage 3 (on);
  the per-step losses must agree within `loss_rtol`;
- scaling: stage 3 at 1 … N train nodes with a fixed batch per node (weak scaling), the median tokens/s of each run;
  efficiency at N = tps(N) / (N · tps(1)) against `min_scaling_efficiency`, with the least-squares slope;
- bandwidth: `shardstack validate`'s all-reduce (its `sweep` of sizes when it has one, else its single size), and
  the time the model's gradients take at that bus bandwidth as a fraction of the N-node step (`max_comm_fraction`);
- GPU: DCGM's utilisation and memory in Prometheus over the N-node run, where the train nodes have NVIDIA GPUs;
  n/a on CPU nodes (no figure is made up);
- kill and resume: a worker of a running job SIGKILLed after its first checkpoints; the job must resume from a
  checkpoint (not step 0), finish, and repeat the steps it re-runs with the same losses;
- the seconds of each item and of the whole.

records.py holds the records, judge.py the verdicts (pure), run.py the running on a cluster (`run_acceptance`); what is
shown while it runs is the caller's (`Hooks`); the report's Markdown and plots are report.py's (matplotlib imported
there only). Callers import from those modules; this package re-exports nothing.
"""
