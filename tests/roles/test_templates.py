"""Rendered configuration: /etc/nccl.conf, NFS exports and mount units, the CUDA profile, sysctl and limits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_nccl_conf_defaults_pick_the_ansible_interface(role_eval: Any, hardware: Any, debian_container: dict) -> None:
    r = role_eval("nccl", debian_container, ansible_host="10.0.0.11", shardstack_hardware=hardware())
    text = r.render("nccl.conf.j2")
    assert text.startswith("#\n# Ansible managed\n#\n")
    assert _lines(text) == ["NCCL_SOCKET_IFNAME=eth0", "NCCL_IB_DISABLE=1", "NCCL_DEBUG=WARN"]


def test_nccl_conf_infiniband_node(role_eval: Any, hardware: Any, debian_container: dict) -> None:
    r = role_eval(
        "nccl",
        debian_container,
        ansible_host="10.0.0.11",
        shardstack_hardware=hardware(rdma=("/sys/class/infiniband/mlx5_0",)),
        nccl_socket_ifname="bond0",
        nccl_ib_hca="=mlx5_0:1,mlx5_1:1",
        nccl_ib_gid_index=3,
        nccl_debug="INFO",
        nccl_topo_file="/etc/nccl/topo.xml",
        nccl_extra_env={"NCCL_NET_GDR_LEVEL": "PHB"},
    )
    assert _lines(r.render("nccl.conf.j2")) == [
        "NCCL_SOCKET_IFNAME=bond0",
        "NCCL_IB_DISABLE=0",
        "NCCL_IB_HCA==mlx5_0:1,mlx5_1:1",
        "NCCL_IB_GID_INDEX=3",
        "NCCL_DEBUG=INFO",
        "NCCL_TOPO_FILE=/etc/nccl/topo.xml",
        "NCCL_NET_GDR_LEVEL=PHB",
    ]


# find -L /sys/class/infiniband -mindepth 4 -maxdepth 4 ... -exec grep -H . on an HGX H100 node: eight ConnectX-7
# compute rails (mlx5_0..3, mlx5_6..9, NDR InfiniBand), a storage rail on the fabric too (mlx5_10), a BlueField-3
# in DPU mode (mlx5_4, mlx5_5: Ethernet link layer), and mlx5_11 uncabled.
IB_PORTS = [
    *(line for ca in (0, 1, 2, 3, 6, 7, 8, 9, 10) for line in (
        f"/sys/class/infiniband/mlx5_{ca}/ports/1/link_layer:InfiniBand",
        f"/sys/class/infiniband/mlx5_{ca}/ports/1/phys_state:5: LinkUp")),
    "/sys/class/infiniband/mlx5_4/ports/1/link_layer:Ethernet",
    "/sys/class/infiniband/mlx5_4/ports/1/phys_state:5: LinkUp",
    "/sys/class/infiniband/mlx5_5/ports/1/link_layer:Ethernet",
    "/sys/class/infiniband/mlx5_5/ports/1/phys_state:5: LinkUp",
    "/sys/class/infiniband/mlx5_11/ports/1/link_layer:InfiniBand",
    "/sys/class/infiniband/mlx5_11/ports/1/phys_state:3: Disabled",
]
RAILS = "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1,mlx5_6:1,mlx5_7:1,mlx5_8:1,mlx5_9:1"


@pytest.mark.parametrize(
    ("overrides", "hca"),
    [
        # Discovered: InfiniBand and LinkUp, less the storage rail; in adapter order (mlx5_10 after mlx5_9).
        ({"nccl_ib_hca_exclude": ["mlx5_10"]}, f"={RAILS}"),
        ({"nccl_ib_hca_exclude": ["mlx5_10:1"]}, f"={RAILS}"),
        ({}, f"={RAILS},mlx5_10:1"),
        # The inventory's rails: a list gets the exact-match prefix, a string is rendered as the operator wrote it.
        ({"nccl_ib_hca": ["mlx5_0:1", "mlx5_1:1"]}, "=mlx5_0:1,mlx5_1:1"),
        ({"nccl_ib_hca": ["mlx5_0", "mlx5_1"]}, "=mlx5_0,mlx5_1"),
        ({"nccl_ib_hca": "mlx5"}, "mlx5"),
        ({"nccl_ib_hca_discover": False}, None),
        ({"nccl_ib_disable": "true"}, None),  # no IB transport: nothing to pick
    ],
)
def test_nccl_ib_hca_compute_rails(role_eval: Any, hardware: Any, debian_container: dict, overrides: dict,
                                   hca: str | None) -> None:
    r = role_eval("nccl", debian_container, ansible_host="10.0.0.11",
                  shardstack_hardware=hardware(rdma=tuple(f"/sys/class/infiniband/mlx5_{i}" for i in range(12))),
                  __nccl_ib_ports={"stdout_lines": IB_PORTS}, **overrides)
    lines = [line for line in _lines(r.render("nccl.conf.j2")) if line.startswith("NCCL_IB_HCA=")]
    assert lines == ([f"NCCL_IB_HCA={hca}"] if hca else [])


def test_nccl_ib_hca_not_discovered_without_adapters(role_eval: Any, hardware: Any, debian_container: dict) -> None:
    r = role_eval("nccl", debian_container, ansible_host="10.0.0.11", shardstack_hardware=hardware())
    assert r["__nccl_ib_discover"] is False
    assert not any(line.startswith("NCCL_IB_HCA") for line in _lines(r.render("nccl.conf.j2")))


@pytest.mark.parametrize(("mpi", "builddir", "flags", "packages"), [
    (True, "/opt/nccl-tests/build-mpi", ["MPI=1", "MPI_HOME=/usr/lib/x86_64-linux-gnu/openmpi"],
     ["git", "make", "g++", "openmpi-bin", "libopenmpi-dev"]),
    (False, "/opt/nccl-tests/build", ["MPI=0"], ["git", "make", "g++"]),
])
def test_nccl_tests_build_with_debians_open_mpi(role_eval: Any, debian_container: dict, mpi: bool, builddir: str,
                                                 flags: list, packages: list) -> None:
    """MPI=1 against Debian's Open MPI (libopenmpi-dev: /usr/lib/x86_64-linux-gnu/openmpi/{include/mpi.h,
    lib/libmpi.so}); each mode builds into its own directory, so switching modes rebuilds."""
    r = role_eval("nccl", {**debian_container, "processor_vcpus": 64}, nccl_tests_mpi=mpi)
    assert r["__nccl_tests_builddir"] == builddir
    assert r["__nccl_tests_make"] == ["make", "-j64", "CUDA_HOME=/usr/local/cuda", f"BUILDDIR={builddir}", *flags]
    assert r["__nccl_tests_packages"] == packages
    arm = role_eval("nccl", {**debian_container, "architecture": "aarch64"}, nccl_tests_mpi=True)
    assert "MPI_HOME=/usr/lib/aarch64-linux-gnu/openmpi" in arm["__nccl_tests_make"]


def test_nccl_ifname_falls_back_to_the_default_route(role_eval: Any, debian_container: dict) -> None:
    facts = {**debian_container, "default_ipv4": {"interface": "ens5"}}
    assert role_eval("nccl", facts, ansible_host="gpu01.example")["__nccl_socket_ifname"] == "ens5"


def test_nccl_ib_disable_forced_off(role_eval: Any, hardware: Any, debian_container: dict) -> None:
    r = role_eval("nccl", debian_container, shardstack_hardware=hardware(), nccl_ib_disable="false")
    assert "NCCL_IB_DISABLE=0" in _lines(r.render("nccl.conf.j2"))


def _storage(role_eval: Any, facts: dict, **kw: Any) -> Any:
    hostvars = {
        "store01": {"ansible_host": "192.0.2.21"},
        "gpu01": {"ansible_host": "192.0.2.11"},
        "gpu02": {},
        "infer01": {"ansible_host": "192.0.2.31"},
        "lb01": {"ansible_host": "192.0.2.41"},
        "mon01": {"ansible_host": "192.0.2.51"},
    }
    groups = {"all": list(hostvars), "storage_server": ["store01"], "train_nodes": ["gpu01", "gpu02"],
              "inference_nodes": ["gpu02", "infer01"], "loadbalancer": ["lb01"], "monitoring_server": ["mon01"]}
    return role_eval("shared_storage", facts, groups=groups, hostvars=hostvars, **kw)


def test_nfs_exports_list_only_the_hosts_that_mount(role_eval: Any, debian_container: dict) -> None:
    """Least privilege: storage and train hosts read-write, an inference-only host read-only (one also training keeps
    read-write), the load balancer and monitoring hosts not at all."""
    r = _storage(role_eval, debian_container, inventory_hostname="store01")
    line = _lines(r.render("exports.j2"))
    opts = "sync,no_subtree_check,root_squash"
    assert line == [f"/srv/nfs/shardstack 192.0.2.11(rw,{opts}) 192.0.2.21(rw,{opts}) gpu02(rw,{opts})"
                    f" 192.0.2.31(ro,{opts})"]
    assert "192.0.2.41" not in line[0] and "192.0.2.51" not in line[0]


def test_nfs_exports_explicit_networks(role_eval: Any, debian_container: dict) -> None:
    r = _storage(role_eval, debian_container, shared_storage_nfs_export_clients=["10.1.0.0/16"],
                 shared_storage_nfs_export_ro_clients=["10.2.0.0/16", "10.1.0.0/16"])
    opts = "sync,no_subtree_check,root_squash"
    assert _lines(r.render("exports.j2")) == [f"/srv/nfs/shardstack 10.1.0.0/16(rw,{opts}) 10.2.0.0/16(ro,{opts})"]


@pytest.mark.parametrize(("host", "member", "read_only"), [
    ("store01", True, False), ("gpu01", True, False), ("gpu02", True, False), ("infer01", True, True),
    ("lb01", False, False), ("mon01", False, False)])
def test_who_mounts_and_how(role_eval: Any, debian_container: dict, host: str, member: bool, read_only: bool) -> None:
    r = _storage(role_eval, debian_container, inventory_hostname=host)
    assert (r["__shared_storage_member"], r["__shared_storage_read_only"]) == (member, read_only)
    if not member:
        assert r["__shared_storage_reason"].startswith(f"no mount: {host} is in none of")


def test_read_only_mount_units(role_eval: Any, debian_container: dict) -> None:
    nfs = _lines(_storage(role_eval, debian_container, inventory_hostname="infer01").render("shared.mount.j2"))
    assert "Options=ro,vers=4.2,hard,noatime,nconnect=8,rsize=1048576,wsize=1048576" in nfs
    bind = _lines(_storage(role_eval, debian_container, inventory_hostname="infer01", shared_storage_backend="bind",
                           shared_storage_bind_source="/mnt/lab-shared").render("shared.mount.j2"))
    assert "Options=bind,ro" in bind


def test_nfs_mount_unit(role_eval: Any, debian_container: dict) -> None:
    r = _storage(role_eval, debian_container, inventory_hostname="gpu01")
    assert r["__shared_storage_unit"] == "srv-shardstack.mount"
    lines = _lines(r.render("shared.mount.j2"))
    assert "What=192.0.2.21:/srv/nfs/shardstack" in lines
    assert "Where=/srv/shardstack" in lines
    assert "Type=nfs" in lines
    assert "Options=vers=4.2,hard,noatime,nconnect=8,rsize=1048576,wsize=1048576" in lines
    assert "WantedBy=remote-fs.target" in lines
    assert "After=network-online.target" in lines


def test_bind_mount_unit_and_escaped_name(role_eval: Any, debian_container: dict) -> None:
    r = _storage(
        role_eval,
        debian_container,
        shared_storage_backend="bind",
        shared_storage_bind_source="/mnt/lab-shared",
        shared_storage_mount_point="/srv/shard-stack/data",
    )
    # systemd-escape --path /srv/shard-stack/data
    assert r["__shared_storage_unit"] == "srv-shard\\x2dstack-data.mount"
    lines = _lines(r.render("shared.mount.j2"))
    assert {"What=/mnt/lab-shared", "Type=none", "Options=bind", "RequiresMountsFor=/mnt/lab-shared"} <= set(lines)
    assert "WantedBy=local-fs.target" in lines


def test_cuda_profile(role_eval: Any, debian_container: dict) -> None:
    distro = role_eval("cuda_toolkit", debian_container, cuda_toolkit_source="distro").render("cuda.sh.j2")
    assert "export CUDA_HOME=/usr" in distro and "PATH" not in distro
    repo = role_eval("cuda_toolkit", debian_container, cuda_toolkit_source="cuda_repo", cuda_toolkit_version="12.4")
    text = repo.render("cuda.sh.j2")
    assert "export CUDA_HOME=/usr/local/cuda-12.4" in text
    assert 'export PATH="${CUDA_HOME}/bin:${PATH}"' in text


def test_sysctl_extra_overrides(role_eval: Any, debian_container: dict) -> None:
    r = role_eval(
        "os_baseline", debian_container, os_baseline_sysctl_extra={"vm.max_map_count": 262144, "vm.swappiness": 1}
    )
    lines = _lines(r.render("sysctl.conf.j2"))
    assert "vm.max_map_count = 262144" in lines and "vm.swappiness = 1" in lines
    assert lines == sorted(lines)


def test_limits_and_systemd_memlock(role_eval: Any, debian_container: dict) -> None:
    r = role_eval("os_baseline", debian_container, groups={"all": ["n1"], "train_nodes": ["n1"]},
                  inventory_hostname="n1")
    assert "shardstack hard nproc 65536" in r.render("limits.conf.j2")
    assert "DefaultLimitMEMLOCK=infinity" in r.render("systemd-limits.conf.j2")
    limited = role_eval("os_baseline", debian_container, os_baseline_limits_memlock="64G")
    assert "DefaultLimitMEMLOCK=64G" in limited.render("systemd-limits.conf.j2")


@pytest.mark.parametrize(("groups", "account"), [
    (["train_nodes"], True), (["inference_nodes"], True), (["storage_server"], True), (["slurm_controller"], True),
    (["loadbalancer"], False), (["monitoring_server"], False), (["loadbalancer", "monitoring_server"], False)])
def test_the_job_account_only_where_jobs_run(role_eval: Any, debian_container: dict, groups: list[str],
                                             account: bool) -> None:
    """A load balancer or monitoring host gets no service account, none of its directories, no limits for it."""
    r = role_eval("os_baseline", debian_container, inventory_hostname="n1",
                  groups={"all": ["n1", "n2"], **{g: ["n1"] for g in groups}, "train_nodes": ["n2"] + (
                      ["n1"] if "train_nodes" in groups else [])})
    assert r["__os_baseline_service_account"] is account
    paths = [d["path"] for d in r["__os_baseline_directories"]]
    assert paths == (["/etc/shardstack", "/opt/shardstack", "/var/lib/shardstack"] if account else ["/opt/shardstack"])
    assert ("shardstack hard nproc" in r.render("limits.conf.j2")) is account
    assert "hard memlock unlimited" in r.render("limits.conf.j2")


def test_nvidia_apt_pin_distro_keeps_nvidias_repository_out(role_eval: Any, debian_container: dict) -> None:
    r = role_eval("nvidia_driver", debian_container, nvidia_driver_source="distro", nvidia_driver_branch="535")
    text = r.render("apt-preferences.j2")
    assert text.startswith("#\n# Ansible managed\n#\n")
    records = [dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith("#"))
               for block in text.split("\n\n")[1:]]
    # First match wins: NVIDIA's driver packages are never candidates, then Debian's branch wins over newer ones.
    assert records[0]["Pin"] == "origin developer.download.nvidia.com" and records[0]["Pin-Priority"] == "-1"
    assert records[1]["Pin"] == "version 535.*" and records[1]["Pin-Priority"] == "1001"
    assert records[0]["Package"] == records[1]["Package"]
    # Globs: a /regex/ costs every apt run seconds of matching against the whole index.
    assert {"nvidia-*", "libnvidia-*", "libcuda[0-9]*"} <= set(records[0]["Package"].split())
    assert not any(p.startswith("/") for p in records[0]["Package"].split())
    mirror = role_eval("nvidia_driver", debian_container, nvidia_driver_source="distro",
                       shardstack_cuda_repo_url="http://cuda-mirror.internal/cuda/repos")
    assert "Pin: origin cuda-mirror.internal\n" in mirror.render("apt-preferences.j2")


def test_nvidia_apt_pin_cuda_repo_keeps_the_distributions_driver_out(role_eval: Any, debian_container: dict) -> None:
    text = role_eval("nvidia_driver", debian_container).render("apt-preferences.j2")
    records = [dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith("#"))
               for block in text.split("\n\n")[1:]]
    # Debian's driver, by the source packages that build it (its helpers, e.g. nvidia-support, stay available).
    assert records[0]["Pin"] == "release o=Debian" and records[0]["Pin-Priority"] == "-1"
    assert {"src:nvidia-graphics-drivers", "src:nvidia-persistenced"} <= set(records[0]["Package"].split())
    assert records[1]["Pin"] == "version 580.*" and records[1]["Pin-Priority"] == "1001"
    exact = role_eval("nvidia_driver", debian_container, nvidia_driver_version="580.65.06-1")
    assert "Pin: version 580.65.06-1\n" in exact.render("apt-preferences.j2")
    ubuntu = {**debian_container, "distribution": "Ubuntu", "distribution_version": "22.04"}
    text = role_eval("nvidia_driver", ubuntu).render("apt-preferences.j2")
    assert "Pin: release o=Ubuntu\n" in text and "src:nvidia-graphics-drivers-580-server" in text


@pytest.mark.parametrize(("driver_cuda", "version", "pin"), [
    ("13.0", "", r"/\+cuda13\./"), ("12.2", "", r"/\+cuda12\./"), ("13.0", "2.27.7-1+cuda13.0", "2.27.7-1+cuda13.0")])
def test_nccl_apt_pin_holds_the_drivers_cuda_major_or_the_version(
    role_eval: Any, hardware: Any, debian_container: dict, driver_cuda: str, version: str, pin: str
) -> None:
    r = role_eval("nccl", debian_container, shardstack_hardware=hardware(), nccl_version=version,
                  nvidia_driver_compat={"branch": "580", "driver_cuda": driver_cuda})
    lines = _lines(r.render("apt-preferences.j2"))
    assert lines[-3:] == ["Package: libnccl2 libnccl-dev", f"Pin: version {pin}", "Pin-Priority: 1001"]


def test_dcgm_unit_uses_the_nodes_host_engine(role_eval: Any, hardware: Any, debian_container: dict) -> None:
    gpu = hardware(pci=("/sys/bus/pci/devices/0000:3b:00.0/vendor",))
    r = role_eval("dcgm_exporter", debian_container, shardstack_hardware=gpu)
    lines = _lines(r.render("dcgm-exporter.service.j2"))
    assert "Requires=nvidia-dcgm.service" in lines
    exec_start = next(line for line in lines if line.startswith("ExecStart="))
    assert exec_start == ("ExecStart=/usr/bin/dcgm-exporter -f /etc/dcgm-exporter/shardstack-counters.csv "
                          "-a 0.0.0.0:9401 -r localhost:5555")


@pytest.mark.parametrize(("driver_cuda", "package"), [("13.0", "datacenter-gpu-manager-4-cuda13"),
                                                      ("12.2", "datacenter-gpu-manager-4-cuda12")])
def test_dcgm_package_follows_the_drivers_cuda_major(
    role_eval: Any, debian_container: dict, driver_cuda: str, package: str
) -> None:
    r = role_eval("dcgm_exporter", debian_container, nvidia_driver_compat={"driver_cuda": driver_cuda})
    assert r["__dcgm_exporter_packages_effective"] == [package, "datacenter-gpu-manager-exporter"]
    mine = role_eval("dcgm_exporter", debian_container, dcgm_exporter_packages=["datacenter-gpu-manager"])
    assert mine["__dcgm_exporter_packages_effective"] == ["datacenter-gpu-manager"]


def test_the_prune_tool_is_found_in_a_checkout_and_in_the_wheel(role_eval: Any, debian_container: dict,
                                                               tmp_path: Path) -> None:
    """shared_storage copies runtime/shardstack/node/artifacts.py to the storage server: found beside the roles in a
    checkout and in the wheel's layout (shardstack/_ansible/roles next to the package), as `deploy` from a wheel
    needs it."""
    repo = Path(__file__).resolve().parents[2]
    here = role_eval("shared_storage", debian_container, role_path=str(repo / "roles/shared_storage"))
    assert Path(here["__shared_storage_prune_source"]).resolve() == repo / "runtime/shardstack/node/artifacts.py"
    wheel = tmp_path / "site-packages/shardstack"
    (wheel / "_ansible/roles/shared_storage").mkdir(parents=True)
    (wheel / "node").mkdir()
    (wheel / "node/artifacts.py").write_text("# the module\n")
    there = role_eval("shared_storage", debian_container, role_path=str(wheel / "_ansible/roles/shared_storage"))
    assert Path(there["__shared_storage_prune_source"]).resolve() == wheel / "node/artifacts.py"


def test_loadbalancer_reads_the_pair_cluster_certificate_issues(role_eval: Any, debian_container: dict) -> None:
    """vars/main.yml names the pair the haproxy PEM is built from; they must be what shardstack_common's
    cluster_certificate.yml issues for the role's prefix, or the PEM would read a file nobody wrote."""
    store = "/srv/inventory/credentials"
    lb = role_eval("loadbalancer", debian_container, inventory_hostname="lb01", loadbalancer_tls_store=store)
    common = role_eval("shardstack_common", debian_container, inventory_hostname="lb01",
                       __shardstack_common_tls_store=store, __shardstack_common_tls_prefix="loadbalancer")
    own = common["__shardstack_common_tls_own"]
    assert (lb["__loadbalancer_cert"], lb["__loadbalancer_key"]) == (own + ".crt.txt", own + ".key.txt")
    assert lb["__loadbalancer_ca_cert"] == f"{store}/cluster-ca.crt.txt"
