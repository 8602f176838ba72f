"""Peak host memory of `shardstack export`: it must track the largest tensor, not the model.

Writes a sharded checkpoint of a preset model (random weights; default gpt2-124m with the byte vocabulary) in one
process, then exports it in a fresh process and reports how far the export raised that process's peak resident
set above its baseline after imports, next to the model size and the largest tensor.

    .venv/bin/python bench/export_memory.py [--preset gpt2-124m] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SAVE = textwrap.dedent("""
    import sys, warnings
    import torch
    from shardstack.train.checkpoint.checkpointer import Checkpointer
    from shardstack.train.config import CheckpointConfig
    from shardstack.model.gpt import GPT, GPTConfig
    from shardstack.model.shapes import GPT_PRESETS as PRESETS
    warnings.simplefilter("ignore")
    config = GPTConfig(**PRESETS[sys.argv[2]])
    torch.manual_seed(0)
    model = GPT(config)
    class Weights:
        def state_dict(self): return {"model": model.state_dict()}
        def load_state_dict(self, sd): raise AssertionError
    cfg = CheckpointConfig(dir=sys.argv[1], interval=1, keep=1, resume="never", async_save=False,
                           signing_key_file=sys.argv[3])
    Checkpointer(cfg, config_hash="bench", job="bench", job_config={"model": config.to_dict()}).save(1, Weights())
""")

EXPORT = textwrap.dedent("""
    import json, sys, warnings
    from shardstack.signing import load_signing_key
    from shardstack.train.export import export_checkpoint
    from shardstack.train.memory.host import tune_allocator
    warnings.simplefilter("ignore")
    tune_allocator()  # as `shardstack export` does
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS: the baseline is the process after its imports
    status = open("/proc/self/status").read().splitlines()
    before = int(next(l for l in status if l.startswith("VmRSS:")).split()[1]) * 1024
    r = export_checkpoint(sys.argv[1], sys.argv[2], key=load_signing_key(sys.argv[4]), dtype=sys.argv[3])
    print(json.dumps({"before": before, "peak": r.peak_rss_bytes, "largest": r.largest_tensor_bytes,
                      "written": r.bytes_written, "tensors": r.tensors, "seconds": r.seconds}))
""")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-124m", help="a key of shardstack.model.shapes.GPT_PRESETS")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardstack-export-bench-") as tmp:
        ckpt, out, key = Path(tmp) / "ckpt", Path(tmp) / "out", Path(tmp) / "checkpoint.key"
        key.write_text(secrets.token_hex(32))
        key.chmod(0o400)
        subprocess.run([sys.executable, "-c", SAVE, str(ckpt), args.preset, str(key)], check=True)
        proc = subprocess.run([sys.executable, "-c", EXPORT, str(ckpt), str(out), args.dtype, str(key)], check=True,
                              capture_output=True, text=True)
        m = json.loads(proc.stdout.strip().splitlines()[-1])
    mib = 2**20
    growth = m["peak"] - m["before"]
    print(f"preset {args.preset}, export dtype {args.dtype}: {m['tensors']} tensors, {m['written'] / mib:.1f} MiB "
          f"written in {m['seconds']:.1f}s")
    print(f"largest tensor {m['largest'] / mib:.1f} MiB; export peak RSS {m['peak'] / mib:.0f} MiB = baseline "
          f"{m['before'] / mib:.0f} MiB + {growth / mib:.1f} MiB "
          f"({growth / m['largest']:.1f}× the largest tensor, {100 * growth / m['written']:.1f}% of the model)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
