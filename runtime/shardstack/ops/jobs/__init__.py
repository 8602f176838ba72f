"""Training jobs by who runs them: `common` (names, status), `systemd` (units), `slurm` (sbatch, squeue, sacct)."""
