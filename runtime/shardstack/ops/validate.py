"""`shardstack validate`: the post-deploy checks (playbooks/validate.yml) and what their published measurements
say failed. GPU nodes are judged on the facts each published (shardstack.accel) by the same decisions the runtime
makes before it starts, so validate fails exactly the nodes where training or serving would refuse to run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardstack.accel import NodeFacts, gpu_problems
from shardstack.ops.inventory import Cluster
from shardstack.ops.runner import RunnerEvent, RunResult, run_playbook


def node_facts(report: dict[str, Any]) -> NodeFacts | None:
    """The facts one node published in validate_gpu; None when its probe produced none."""
    facts = (report.get("accel") or {}).get("facts")
    return NodeFacts.from_dict(facts) if facts else None


def gpu_findings(gpu: dict[str, Any], allreduce: dict[str, Any] | None) -> list[str]:
    """Per node, each check (driver, torch build, cuda, dcgm, PCIe) that fails; and the backend of the all-reduce."""
    bad = []
    nvidia_train_nodes = []
    for host, report in sorted(gpu.items()):
        facts = node_facts(report)
        if facts is None:
            why = report.get("accel_error") or "no output"
            bad.append(f"{host}: node facts: `python -m shardstack.accel` gave no result: {why}")
            continue
        bad += [f"{host}: {p}" for p in gpu_problems(facts)]
        # ACS on a PCIe switch or IOMMU translation since the deploy (a BIOS update, a new kernel command line):
        # GPU peer-to-peer and GPUDirect RDMA silently slow down or stop.
        bad += [f"{host}: pcie: {p}" for p in report.get("pcie_problems") or []]
        if facts.has_nvidia and report.get("train_node"):
            nvidia_train_nodes.append(host)
    if allreduce and allreduce.get("backend") != "nccl" and nvidia_train_nodes:
        bad.append(f"backend: the all-reduce ran on {allreduce.get('backend')}, not NCCL, although train node(s) "
                   f"{', '.join(nvidia_train_nodes)} have NVIDIA GPUs")
    return bad


def validate_findings(data: dict[str, Any]) -> list[str]:
    """What failed in validate.yml's published measurements (empty = everything passed)."""
    bad = gpu_findings(data.get("validate_gpu") or {}, data.get("validate_allreduce"))
    if not data.get("validate_gpu"):
        bad.append("gpu: no result")
    ar = data.get("validate_allreduce")
    if not ar:
        errors = data.get("validate_allreduce_errors") or {}
        bad.append("all-reduce: no result" + "".join(f"; {h}: {e}" for h, e in sorted(errors.items())))
    elif not ar.get("correct"):
        bad.append("all-reduce: wrong sum")
    elif ar.get("below_floor"):
        bad.append(f"all-reduce: bus bandwidth {ar['busbw_gbps']:.2f} Gbit/s at {ar['bytes'] / 2**20:g} MiB over "
                   f"{ar['world_size']} rank(s) on {ar['backend']} is below the floor of {ar['busbw_min_gbps']:g} "
                   "Gbit/s (validate_allreduce_busbw_min)")
    for host, st in (data.get("validate_storage") or {}).items():
        if not st.get("peer_checksum_matches"):
            bad.append(f"storage: {host} read different bytes than {st.get('read_of')} wrote")
    if not data.get("validate_storage"):
        bad.append("storage: no result")
    inf = data.get("validate_inference")
    if not inf:
        bad.append("inference: no result")
    elif int(inf.get("status", -1)) != 200:
        # -1: no HTTP answer at all; the reason (refused, a certificate not trusted …) is the probe's message.
        why = f": {str(inf['text'])[:300]}" if inf.get("text") else ""
        bad.append(f"inference: load balancer answered {inf.get('status')}{why}")
    return bad


def run_validate(cluster: Cluster, *, allreduce_mb: float | None = None, allreduce_busbw_min: str | None = None,
                 limit: str | None = None, extravars: dict[str, Any] | None = None,
                 on_event: Callable[[RunnerEvent], None] | None = None) -> tuple[RunResult, list[str]]:
    """allreduce_mb: the sweep's largest size (None: the node's default for its backend); allreduce_busbw_min:
    `auto` or Gbit/s (None: the playbook's default, auto)."""
    ours = {"validate_allreduce_mb": allreduce_mb, "validate_allreduce_busbw_min": allreduce_busbw_min}
    result = run_playbook("playbooks/validate.yml", cluster.path, limit=limit, on_event=on_event,
                          extravars={**(extravars or {}), **{k: v for k, v in ours.items() if v is not None}})
    return result, validate_findings(result.data)
