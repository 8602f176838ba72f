"""The controller installs shardstack without torch: its commands and the job config must not need it.

A child interpreter makes torch (and every torch.* module) unimportable before anything else runs, then imports every
cli and ops module, validates job configs as `train submit --config` does, and runs controller commands' --help.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"

CHILD = textwrap.dedent("""
    import importlib, pkgutil, sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is not installed here ({name})")

    sys.meta_path.insert(0, NoTorch())

    import shardstack.cli
    import shardstack.ops
    for pkg in (shardstack.cli, shardstack.ops):
        for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            importlib.import_module(mod.name)

    from shardstack.train.config import load_config
    job = load_config(sys.argv[1])
    assert job.model.init_from == "/srv/shardstack/pretrained/llama-1b" and job.engine.stage == 3
    gpt = load_config(sys.argv[2])
    assert gpt.model.arch == "gpt" and gpt.model.overrides.n_layer == 3

    from shardstack.cli import main
    for argv in (["train", "submit", "--help"], ["status", "--help"], ["serve", "rollout", "--help"]):
        try:
            main(argv)
        except SystemExit as exc:  # argparse's --help exits 0
            assert exc.code == 0, (argv, exc.code)
    assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules), "torch was imported"
    assert "matplotlib" not in sys.modules, "matplotlib was imported (only the acceptance report's writer needs it)"
    print("ok")
""")

# The shape of docs/quickstart-cluster.md's job.yaml, and a built-in architecture with overrides.
QUICKSTART_JOB = """\
name: run1
model: {init_from: /srv/shardstack/pretrained/llama-1b, seq_len: 2048}
data: {path: /srv/shardstack/data/corpus-llama, tokenizer: /srv/shardstack/pretrained/llama-1b}
engine: {stage: 3, precision: bf16, activation_checkpointing: full}
optimizer: {lr: 2.0e-5}
schedule: {warmup_steps: 20, total_steps: 500}
batch: {global_batch: 64, micro_batch: 2}
checkpoint: {dir: /srv/shardstack/checkpoints/run1, interval: 100, keep: 3, resume: auto}
metrics: {port: 9400}
"""
GPT_JOB = "model: {arch: gpt, size: tiny, n_layer: 3, dropout: 0.1}\nengine: {tensor_parallel: 1}\n"


def test_controller_commands_run_without_torch(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(QUICKSTART_JOB)
    (tmp_path / "gpt.yaml").write_text(GPT_JOB)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "job.yaml"), str(tmp_path / "gpt.yaml")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PYTHONPATH": str(RUNTIME), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
