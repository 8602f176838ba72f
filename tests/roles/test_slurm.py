"""The slurm role's rendered files: slurm.conf (nodes from slurmd -C, GPUs as GRES, cgroup or container plugins),
gres.conf, cgroup.conf, scheduling.conf and slurmdbd.conf; and the munge key's generation."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

SLURMD_C = ("NodeName=gpu01 CPUs=64 Boards=1 SocketsPerBoard=2 CoresPerSocket=16 ThreadsPerCore=2 "
            "RealMemory=515000 UpTime=3-01:02:03")


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def _node(name: str, addr: str, gpus: list[dict[str, str]], memory: int = 500000) -> dict[str, Any]:
    return {"name": name, "addr": addr, "cpus": 64, "boards": 1, "sockets_per_board": 2, "cores_per_socket": 16,
            "threads_per_core": 2, "real_memory": memory, "gpus": gpus}


def _cluster(role_eval: Any, facts: dict, *, containers: bool = False, **kw: Any) -> Any:
    """ops01 is the controller, gpu01 (2 GPUs) and cpu01 (none) the compute nodes, as configure.yml left them."""
    virt = "container" if containers else "kvm"
    release = facts["distribution_major_version"]
    hostvars = {
        "ops01": {"ansible_host": "192.0.2.5", "ansible_facts": {"hostname": "ops01", "virtualization_type": virt,
                                                                 "distribution_major_version": release},
                  **kw.pop("controller_vars", {})},
        "gpu01": {"ansible_host": "192.0.2.11", "ansible_facts": {"hostname": "gpu01", "virtualization_type": virt},
                  "__slurm_node": _node("gpu01", "192.0.2.11", [{"file": "/dev/nvidia0", "cores": "0-15"},
                                                                {"file": "/dev/nvidia1", "cores": ""}])},
        "cpu01": {"ansible_host": "192.0.2.12", "ansible_facts": {"hostname": "cpu01", "virtualization_type": virt},
                  "__slurm_node": _node("cpu01", "192.0.2.12", [], memory=250000)},
    }
    for host, features in kw.pop("features", {}).items():  # what configure.yml's fact says of the host
        hostvars[host]["__slurm_node"]["features"] = features
    groups = {"all": list(hostvars), "slurm_controller": ["ops01"], "train_nodes": ["gpu01", "cpu01"],
              **kw.pop("groups", {})}
    kw.setdefault("inventory_hostname", "ops01")
    kw.setdefault("slurm_db_password", "s3cret-password-0123")
    return role_eval("slurm", facts, groups=groups, hostvars=hostvars, **kw)


def test_slurm_conf_nodes_gres_and_partition(role_eval: Any, debian_container: dict) -> None:
    lines = _lines(_cluster(role_eval, debian_container).render("slurm.conf.j2"))
    assert "SlurmctldHost=ops01(192.0.2.5)" in lines
    assert "AccountingStorageHost=192.0.2.5" in lines and "AccountingStoragePort=6819" in lines
    assert "AccountingStorageEnforce=associations,limits,qos" in lines and "AccountingStorageTRES=gres/gpu" in lines
    assert ("NodeName=gpu01 NodeAddr=192.0.2.11 CPUs=64 Boards=1 SocketsPerBoard=2 CoresPerSocket=16 "
            "ThreadsPerCore=2 RealMemory=500000 Gres=gpu:2 State=UNKNOWN") in lines
    cpu_line = next(line for line in lines if line.startswith("NodeName=cpu01"))
    assert "Gres=" not in cpu_line and "RealMemory=250000" in cpu_line  # CPU-only nodes declare no GRES
    assert "PartitionName=train Nodes=gpu01,cpu01 Default=YES MaxTime=INFINITE State=UP" in lines
    # Preemption by QOS, the preempted job requeued (no QOS preempts another unless slurm_qos says so).
    assert {"PreemptType=preempt/qos", "PreemptMode=REQUEUE"} <= set(lines)
    assert lines[-1] == "Include /etc/slurm/scheduling.conf"


def test_cgroup_plugins_on_real_nodes_linuxproc_in_containers(role_eval: Any, debian_container: dict) -> None:
    real = _cluster(role_eval, debian_container)
    assert real["__slurm_cgroup"] is True
    lines = _lines(real.render("slurm.conf.j2"))
    assert {"ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup,task/affinity",
            "JobAcctGatherType=jobacct_gather/cgroup"} <= set(lines)
    assert {"ConstrainCores=yes", "ConstrainRAMSpace=yes", "ConstrainDevices=yes"} <= set(
        _lines(real.render("cgroup.conf.j2")))

    lab = _cluster(role_eval, debian_container, containers=True)
    assert lab["__slurm_cgroup"] is False
    lines = _lines(lab.render("slurm.conf.j2"))
    assert {"ProctrackType=proctrack/linuxproc", "TaskPlugin=task/affinity"} <= set(lines)
    assert not any("cgroup" in line for line in lines)
    assert _lines(lab.render("cgroup.conf.j2")) == ["CgroupPlugin=autodetect"]
    # Slurm 24.11 (Debian 13) loads the cgroup plugin unless it is disabled, and cgroup/v2 refuses a lab node.
    trixie = _cluster(role_eval, {**debian_container, "distribution_major_version": "13"}, containers=True)
    assert _lines(trixie.render("cgroup.conf.j2")) == ["CgroupPlugin=disabled"]
    # Forced on, whatever the nodes are.
    assert _cluster(role_eval, debian_container, containers=True, slurm_cgroup=True)["__slurm_cgroup"] is True


def test_gres_conf_lists_each_gpu_of_gpu_nodes_only(role_eval: Any, debian_container: dict) -> None:
    lines = _lines(_cluster(role_eval, debian_container).render("gres.conf.j2"))
    # Cores= only where the GPU is near some cores, not all.
    assert lines == ["NodeName=gpu01 Name=gpu File=/dev/nvidia0 Cores=0-15",
                     "NodeName=gpu01 Name=gpu File=/dev/nvidia1"]


def test_this_node_from_slurmd_c_with_memory_headroom_and_gpus_in_numeric_order(
    role_eval: Any, hardware: Any, debian_container: dict
) -> None:
    devs = tuple(f"/dev/nvidia{i}" for i in (10, 2, 0, 1))
    facts = {**debian_container, "hostname": "gpu01"}
    r = _cluster(role_eval, facts, inventory_hostname="gpu01", ansible_host="192.0.2.11",
                 __slurm_hw={"rc": 0, "stdout_lines": [SLURMD_C, "UpTime=1"]},
                 shardstack_hardware=hardware(devnodes=devs))
    node = r["__slurm_this_node"]
    assert {k: int(v) for k, v in node.items() if k not in ("name", "addr", "gpus", "features")} == {
        "cpus": 64, "boards": 1, "sockets_per_board": 2, "cores_per_socket": 16, "threads_per_core": 2,
        "real_memory": 515000 - 10300,  # 2 % of 515000 is more than the 1024 MiB floor
    }
    assert node["name"] == "gpu01" and node["addr"] == "192.0.2.11"
    # No PCI functions to count (nothing to read them from): the device files, in numeric order.
    assert [g["file"] for g in node["gpus"]] == ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia10"]


def test_this_node_without_slurmd_uses_ansible_facts_and_the_floor(
    role_eval: Any, hardware: Any, debian_container: dict
) -> None:
    facts = {**debian_container, "hostname": "cpu01", "memtotal_mb": 8000, "processor_vcpus": 4,
             "processor_count": 1, "processor_cores": 4, "processor_threads_per_core": 1}
    r = _cluster(role_eval, facts, inventory_hostname="cpu01", __slurm_hw={"rc": 2, "stdout_lines": []},
                 shardstack_hardware=hardware())
    node = r["__slurm_this_node"]
    assert int(node["cpus"]) == 4 and int(node["real_memory"]) == 8000 - 1024 and node["gpus"] == []


def test_scheduling_conf_requeue_and_priorities(role_eval: Any, debian_container: dict) -> None:
    r = _cluster(role_eval, debian_container, slurm_extra_config={"MaxJobCount": 20000})
    lines = _lines(r.render("scheduling.conf.j2"))
    assert {"JobRequeue=1", "ReturnToService=1", "SlurmdTimeout=300", "KillWait=330",
            "PriorityWeightFairshare=10000", "SchedulerType=sched/backfill"} <= set(lines)
    # A preempted training job gets its SIGUSR1 at once and its QOS's GraceTime to save a checkpoint. Slurm 22.05 reads
    # the flag from SlurmctldParameters only: under SchedulerParameters it is ignored, and the job gets SIGTERM.
    assert "SlurmctldParameters=preempt_send_user_signal" in lines
    assert lines[-1] == "MaxJobCount=20000"


@pytest.mark.parametrize(("debian", "sinfo", "spelling"), [
    ("12", None, "SlurmctldParameters=preempt_send_user_signal"),  # before the install (check mode): 22.05
    ("13", None, "PreemptParameters=send_user_signal"),  # Debian 13: 24.11
    ("12", "slurm-wlm 22.05.8", "SlurmctldParameters=preempt_send_user_signal"),
    ("13", "slurm-wlm 24.11.5", "PreemptParameters=send_user_signal"),
    ("12", "slurm 23.02.7", "PreemptParameters=send_user_signal"),  # the installed release decides (a backport)
])
def test_preemption_signal_in_the_spelling_of_the_controllers_slurm(
        role_eval: Any, debian_container: dict, debian: str, sinfo: str | None, spelling: str) -> None:
    facts = {**debian_container, "distribution_major_version": debian}
    installed = {"__slurm_installed_version": {"rc": 0, "stdout": sinfo}} if sinfo else {}
    lines = _lines(_cluster(role_eval, facts, controller_vars=installed).render("scheduling.conf.j2"))
    assert spelling in lines
    assert not {"SlurmctldParameters=preempt_send_user_signal", "PreemptParameters=send_user_signal"} - {spelling} \
        & set(lines)


def test_every_qos_gets_the_grace_time_unless_it_sets_its_own(role_eval: Any, debian_container: dict) -> None:
    """preempt/qos gives a preempted job its QOS's GraceTime, which is 0 (an immediate requeue, no checkpoint)
    unless set."""
    r = _cluster(role_eval, debian_container, slurm_preempt_grace_time=240,
                 slurm_qos=[{"name": "normal", "priority": 10}, {"name": "long", "grace_time": 900},
                            {"name": "inference", "preempt": ["normal", "long"]}])
    assert r["__slurm_qos"] == [{"name": "normal", "priority": 10, "grace_time": 240},
                                {"name": "long", "grace_time": 900},
                                {"name": "inference", "preempt": ["normal", "long"], "grace_time": 240}]


def test_slurmdbd_conf(role_eval: Any, debian_container: dict) -> None:
    lines = _lines(_cluster(role_eval, debian_container).render("slurmdbd.conf.j2"))
    assert lines == ["AuthType=auth/munge", "DbdHost=ops01", "DbdPort=6819", "SlurmUser=slurm",
                     "PidFile=/run/slurmdbd.pid", "StorageType=accounting_storage/mysql", "StorageHost=localhost",
                     "StorageLoc=slurm_acct_db", "StorageUser=slurm", "StoragePass=s3cret-password-0123"]


def test_generated_db_password_is_created_once_owner_only_and_reused(
    role_eval: Any, debian_container: dict, tmp_path: Any
) -> None:
    store = tmp_path / "credentials" / "slurmdbd-db-password.txt"
    first = _cluster(role_eval, debian_container, slurm_db_password="", slurm_db_password_store=str(store))
    again = _cluster(role_eval, debian_container, slurm_db_password="", slurm_db_password_store=str(store))
    assert len(first["__slurm_db_password"]) == 40 and first["__slurm_db_password"].isalnum()
    assert first["__slurm_db_password"] == again["__slurm_db_password"]
    assert store.stat().st_mode & 0o077 == 0  # the controller's copy is the owner's only


def test_munge_key_generated_once_on_the_controller_or_given(
    role_eval: Any, debian_container: dict, tmp_path: Any
) -> None:
    store = tmp_path / "credentials" / "munge-key.txt"
    first = role_eval("munge", debian_container, munge_key_store=str(store))["__munge_key"]
    assert len(first) == 128 and first.isalnum()
    assert role_eval("munge", debian_container, munge_key_store=str(store))["__munge_key"] == first
    assert store.stat().st_mode & 0o077 == 0
    given = "k" * 40
    assert role_eval("munge", debian_container, munge_key=given, munge_key_store=str(store))["__munge_key"] == given


def test_credential_stores_are_files_the_inventory_parser_skips() -> None:
    """Stores live in <inventory>/credentials/: Ansible parses every file under an inventory directory except a few
    extensions (.txt among them), so `munge.key` became a host named after the key, printed in every play."""
    roles = Path(__file__).resolve().parents[2] / "roles"
    stores = {name: value for path in roles.glob("*/defaults/main.yml")
              for name, value in (yaml.safe_load(path.read_text()) or {}).items() if name.endswith("_store")}
    assert {"munge_key_store", "slurm_db_password_store", "inference_service_token_store"} <= set(stores)
    # The TLS stores are directories (their files are named *.txt by the roles that write them).
    assert all(str(v).endswith(".txt") for k, v in stores.items() if not k.endswith("_tls_store")), stores


# An HGX node as slurmd -C sees it: 2 sockets × 56 cores × 2 threads. Linux numbers the first thread of every core
# socket by socket (0-55, 56-111), then their siblings (112-167, 168-223); Intel's core_ids have gaps.
HGX_SLURMD_C = ("NodeName=gpu01 CPUs=224 Boards=1 SocketsPerBoard=2 CoresPerSocket=56 ThreadsPerCore=2 "
                "RealMemory=2063000")
HGX_GPUS = [f"/sys/bus/pci/devices/0000:{bus}:00.0" for bus in ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")]
HGX_SWITCHES = [f"/sys/bus/pci/devices/0000:{bus}:00.0" for bus in ("05", "06", "07", "08")]


def _hgx_topology() -> list[str]:
    lines = []
    for cpu in range(224):
        core = cpu % 112
        lines += [f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id:{core // 56}",
                  f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id:{(core % 56) * 2}"]
    for i, gpu in enumerate(HGX_GPUS):
        lines.append(f"{gpu}/local_cpulist:{'0-55,112-167' if i < 4 else '56-111,168-223'}")
    return lines


def _hgx(role_eval: Any, hardware: Any, debian_container: dict, topology: list[str], devnodes=()) -> Any:
    facts = {**debian_container, "hostname": "gpu01", "virtualization_type": "kvm"}
    return _cluster(role_eval, facts, inventory_hostname="gpu01", ansible_host="192.0.2.11",
                    __slurm_hw={"rc": 0, "stdout_lines": [HGX_SLURMD_C]},
                    __slurm_topology={"stdout_lines": topology},
                    shardstack_hardware=hardware(pci=tuple(f"{g}/vendor" for g in HGX_GPUS), devnodes=devnodes,
                                                 nvswitch=tuple(HGX_SWITCHES)))


def test_first_run_counts_gpus_from_pci_before_any_driver_with_the_cores_near_each(
    role_eval: Any, hardware: Any, debian_container: dict
) -> None:
    """The first deploy probes before the driver exists: no /dev/nvidia<N> yet, so GRES came out empty and
    `--gres=gpu:8` was refused until a second run. The PCI functions (display/3D class; NVSwitches are bridges)
    give 8 GPUs at once, each with the cores of its socket as Slurm numbers them."""
    r = _hgx(role_eval, hardware, debian_container, _hgx_topology())
    gpus = r["__slurm_this_node"]["gpus"]
    assert [g["file"] for g in gpus] == [f"/dev/nvidia{i}" for i in range(8)]
    assert [g["cores"] for g in gpus] == ["0-55"] * 4 + ["56-111"] * 4
    nodes = {"gpu01": {**r["__slurm_this_node"], "name": "gpu01"}}
    hostvars = {"ops01": {"ansible_host": "192.0.2.5", "ansible_facts": {"hostname": "ops01",
                                                                        "virtualization_type": "kvm"}},
                "gpu01": {"ansible_host": "192.0.2.11", "ansible_facts": {"hostname": "gpu01",
                                                                         "virtualization_type": "kvm"},
                          "__slurm_node": nodes["gpu01"]}}
    conf = role_eval("slurm", debian_container, groups={"all": list(hostvars), "slurm_controller": ["ops01"],
                                                        "train_nodes": ["gpu01"]},
                     hostvars=hostvars, inventory_hostname="ops01", slurm_db_password="s3cret-password-0123")
    assert _lines(conf.render("gres.conf.j2"))[::7] == ["NodeName=gpu01 Name=gpu File=/dev/nvidia0 Cores=0-55",
                                                        "NodeName=gpu01 Name=gpu File=/dev/nvidia7 Cores=56-111"]
    node_line = next(line for line in _lines(conf.render("slurm.conf.j2")) if line.startswith("NodeName=gpu01"))
    assert " Gres=gpu:8 " in node_line and "CPUs=224" in node_line
    # Once the driver has made the device files the answer is the same.
    again = _hgx(role_eval, hardware, debian_container, _hgx_topology(),
                 devnodes=tuple(f"/dev/nvidia{i}" for i in range(8)))
    assert again["__slurm_this_node"]["gpus"] == gpus


def test_cores_are_slurms_core_indexes_not_cpu_numbers(role_eval: Any, hardware: Any,
                                                       debian_container: dict) -> None:
    """CPUs numbered alternately across the two sockets (some BIOSes do): Slurm numbers cores socket by socket, so
    socket 0's CPUs 0,2,…,110 are its cores 0-55, whatever their CPU numbers."""
    lines = []
    for cpu in range(224):
        core = cpu % 112
        lines += [f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id:{core % 2}",
                  f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id:{core // 2}"]
    socket0 = ",".join(str(c) for c in range(0, 224, 2))
    socket1 = ",".join(str(c) for c in range(1, 224, 2))
    lines += [f"{gpu}/local_cpulist:{socket0 if i % 2 == 0 else socket1}" for i, gpu in enumerate(HGX_GPUS)]
    gpus = _hgx(role_eval, hardware, debian_container, lines)["__slurm_this_node"]["gpus"]
    assert [g["cores"] for g in gpus] == ["0-55", "56-111"] * 4


def test_no_cores_rather_than_wrong_ones(role_eval: Any, hardware: Any, debian_container: dict) -> None:
    """No topology read (or one that disagrees with slurmd -C, or a GPU near every core): GPUs without Cores=."""
    none = _hgx(role_eval, hardware, debian_container, [])["__slurm_this_node"]["gpus"]
    assert [g["cores"] for g in none] == [""] * 8
    # A core missing (CPUs 111 and 223, offline): 111 cores, not slurmd's 112, so the indexes cannot be trusted.
    partial = [line for line in _hgx_topology() if "/cpu111/" not in line and "/cpu223/" not in line]
    gpus = _hgx(role_eval, hardware, debian_container, partial)["__slurm_this_node"]["gpus"]
    assert [g["cores"] for g in gpus] == [""] * 8
    everywhere = [line.replace("0-55,112-167", "0-223").replace("56-111,168-223", "0-223") for line in _hgx_topology()]
    gpus = _hgx(role_eval, hardware, debian_container, everywhere)["__slurm_this_node"]["gpus"]
    assert [g["cores"] for g in gpus] == [""] * 8 and len(gpus) == 8


def test_slurmd_on_gpu_nodes_waits_for_the_device_files_gres_conf_names(role_eval: Any,
                                                                        debian_container: dict) -> None:
    """slurmd exits (fatal: can't stat gres.conf file /dev/nvidia0) when a File= is missing, which the first deploy
    now declares before the driver may have created them: the drop-in creates them at start and retries."""
    import configparser

    text = _cluster(role_eval, debian_container, inventory_hostname="gpu01").render("slurmd-gpu.conf.j2")
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment]
    unit.read_string(text)
    assert unit["Service"]["ExecStartPre"] == "-/usr/bin/nvidia-smi -L"  # "-": a failure only delays the start
    assert unit["Service"]["Restart"] == "on-failure" and unit["Unit"]["StartLimitIntervalSec"] == "0"
    tasks = yaml.safe_load((Path(__file__).resolve().parents[2] / "roles/slurm/tasks/configure.yml").read_text())
    by_name = {t["name"]: t for t in tasks}
    dropin = by_name["Configure - slurmd waits for the GPUs' device files"]
    assert "__slurm_node.gpus | length > 0" in dropin["when"] and "slurm restart" in dropin["notify"]
    assert by_name["Configure - no GPU drop-in on nodes without GPUs"]["ansible.builtin.file"]["state"] == "absent"


def test_nodes_in_inference_nodes_have_the_inference_feature(role_eval: Any, hardware: Any,
                                                              debian_container: dict) -> None:
    for host, features in (("gpu01", ["inference"]), ("cpu01", [])):
        r = _cluster(role_eval, {**debian_container, "hostname": host}, inventory_hostname=host,
                     groups={"inference_nodes": ["gpu01"]}, __slurm_hw={"rc": 0, "stdout_lines": [SLURMD_C]},
                     shardstack_hardware=hardware())
        assert r["__slurm_this_node"]["features"] == features, host
    lines = _lines(_cluster(role_eval, debian_container, features={"gpu01": ["inference"]}).render("slurm.conf.j2"))
    assert next(line for line in lines if line.startswith("NodeName=gpu01")).endswith(
        " Gres=gpu:2 Features=inference State=UNKNOWN")
    assert "Features=" not in next(line for line in lines if line.startswith("NodeName=cpu01"))
    assert not any(line.startswith(("Prolog", "Epilog=")) for line in lines)  # no slurm_account_units


_SYSTEMCTL = """#!/bin/sh
echo "$*" >> "$RECORD"
"""


def test_a_job_of_an_account_unit_runs_that_unit_from_its_prolog_to_its_epilog(
        role_eval: Any, debian_container: dict, tmp_path: Path) -> None:
    units = {"inference": "shardstack-inference.service"}
    conf = _cluster(role_eval, debian_container, slurm_account_units=units)
    lines = _lines(conf.render("slurm.conf.j2"))
    assert {"PrologFlags=Alloc", "Prolog=/etc/slurm/shardstack-prolog.sh",
            "Epilog=/etc/slurm/shardstack-epilog.sh"} <= set(lines)
    bindir, state, record = tmp_path / "bin", tmp_path / "state", tmp_path / "record"
    bindir.mkdir()
    (bindir / "systemctl").write_text(_SYSTEMCTL)
    (bindir / "systemctl").chmod(0o755)
    scripts = {}
    for kind, epilog in (("prolog", False), ("epilog", True)):
        text = _cluster(role_eval, debian_container, slurm_account_units=units, __slurm_units_state=str(state),
                        __slurm_units_epilog=epilog).render("account-units.sh.j2")
        scripts[kind] = tmp_path / f"{kind}.sh"
        scripts[kind].write_text(text)

    def run(kind: str, job: str, account: str | None = None) -> list[str]:
        env = {"PATH": f"{bindir}:{os.environ['PATH']}", "RECORD": str(record), "SLURM_JOB_ID": job,
               **({"SLURM_JOB_ACCOUNT": account} if account else {})}
        record.write_text("")
        done = subprocess.run(["sh", str(scripts[kind])], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return record.read_text().splitlines()

    # A team's job: nothing started, nothing remembered, nothing stopped.
    assert run("prolog", "6", "research") == [] and run("epilog", "6") == []
    # The inference account's job starts the unit without waiting for it, and its epilog stops it (Slurm 22.05 may
    # not give the epilog the account: the job id the prolog wrote decides).
    assert run("prolog", "7", "inference") == ["start --no-block shardstack-inference.service"]
    assert (state / "7").read_text() == "shardstack-inference.service\n" and oct(state.stat().st_mode)[-3:] == "700"
    assert run("epilog", "7") == ["stop shardstack-inference.service"] and not (state / "7").exists()
    assert run("epilog", "7") == []  # once only
