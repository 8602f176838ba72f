"""Rendered configuration: /etc/nccl.conf, NFS exports and mount units, the CUDA profile, sysctl and limits."""

from __future__ import annotations

from typing import Any


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
    }
    groups = {"all": ["store01", "gpu01", "gpu02"], "storage_server": ["store01"]}
    return role_eval("shared_storage", facts, groups=groups, hostvars=hostvars, **kw)


def test_nfs_exports_list_every_inventory_host(role_eval: Any, debian_container: dict) -> None:
    r = _storage(role_eval, debian_container, inventory_hostname="store01")
    line = _lines(r.render("exports.j2"))
    opts = "(rw,sync,no_subtree_check,root_squash)"
    assert line == [f"/srv/nfs/shardstack 192.0.2.11{opts} 192.0.2.21{opts} gpu02{opts}"]


def test_nfs_exports_explicit_networks(role_eval: Any, debian_container: dict) -> None:
    r = _storage(role_eval, debian_container, shared_storage_nfs_export_clients=["10.1.0.0/16"])
    assert _lines(r.render("exports.j2")) == ["/srv/nfs/shardstack 10.1.0.0/16(rw,sync,no_subtree_check,root_squash)"]


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
    distro = role_eval("cuda_toolkit", debian_container).render("cuda.sh.j2")
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
    r = role_eval("os_baseline", debian_container)
    assert "shardstack hard nproc 65536" in r.render("limits.conf.j2")
    assert "DefaultLimitMEMLOCK=infinity" in r.render("systemd-limits.conf.j2")
    limited = role_eval("os_baseline", debian_container, os_baseline_limits_memlock="64G")
    assert "DefaultLimitMEMLOCK=64G" in limited.render("systemd-limits.conf.j2")


def test_nvidia_apt_pin(role_eval: Any, debian_container: dict) -> None:
    branch = _lines(
        role_eval("nvidia_driver", debian_container, nvidia_driver_branch="550").render("apt-preferences.j2")
    )
    assert "Pin: version 550.*" in branch and "Pin-Priority: 1001" in branch
    exact = role_eval("nvidia_driver", debian_container, nvidia_driver_version="535.216.01-1~deb12u1")
    assert "Pin: version 535.216.01-1~deb12u1" in exact.render("apt-preferences.j2")
