"""The Python filters: ibstat parsing (rdma) and the preflight's variable catalog."""

from __future__ import annotations

from pathlib import Path

import yaml
from ansible_vars import load_module

REPO = Path(__file__).resolve().parents[2]


rdma = load_module(REPO / "roles/rdma/filter_plugins/rdma.py")
inv = load_module(REPO / "playbooks/filter_plugins/shardstack_inventory.py")

IBSTAT = """\
CA 'mlx5_0'
\tCA type: MT4123
\tNumber of ports: 1
\tFirmware version: 20.31.1014
\tHardware version: 0
\tNode GUID: 0x0c42a10300a1b2c3
\tSystem image GUID: 0x0c42a10300a1b2c3
\tPort 1:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tRate: 200
\t\tBase lid: 12
\t\tLMC: 0
\t\tSM lid: 1
\t\tCapability mask: 0xa651e848
\t\tPort GUID: 0x0c42a10300a1b2c3
\t\tLink layer: InfiniBand
CA 'mlx5_1'
\tCA type: MT4123
\tNumber of ports: 2
\tPort 1:
\t\tState: Down
\t\tPhysical state: Polling
\t\tRate: 10
\t\tLink layer: InfiniBand
\tPort 2:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tRate: 2.5
\t\tLink layer: Ethernet
"""


def test_parse_ibstat() -> None:
    ports = rdma.parse_ibstat(IBSTAT)
    assert [(p["ca"], p["port"], p["state"], p["physical"], p["rate"], p["link_layer"]) for p in ports] == [
        ("mlx5_0", 1, "Active", "LinkUp", 200.0, "InfiniBand"),
        ("mlx5_1", 1, "Down", "Polling", 10.0, "InfiniBand"),
        ("mlx5_1", 2, "Active", "LinkUp", 2.5, "Ethernet"),
    ]


def test_parse_ibstat_empty() -> None:
    assert rdma.parse_ibstat("") == []


def test_catalog_covers_every_role_in_the_repository() -> None:
    catalog = inv.known_variables(str(REPO))
    roles = sorted(p.name for p in (REPO / "roles").iterdir() if p.is_dir())
    assert {r + "_" for r in roles} <= set(catalog["prefixes"])
    for role in roles:
        defaults = REPO / "roles" / role / "defaults" / "main.yml"
        if defaults.is_file():
            assert set(yaml.safe_load(defaults.read_text()) or {}) <= set(catalog["known"]), role


def test_shared_variables_known_and_their_typos_caught() -> None:
    catalog = inv.known_variables(str(REPO))
    assert {"shardstack_shared_dir", "shardstack_user", "shardstack_group", "shardstack_cuda_repo_url"} <= set(
        catalog["known"]
    )
    names = ["shardstack_shared_dir", "shardstack_shared_dri", "shardstack_cuda_repo", "nvidia_driver_cuda_repo_url"]
    assert inv.unknown_variables(names, catalog) == [
        "nvidia_driver_cuda_repo_url",
        "shardstack_cuda_repo (did you mean shardstack_cuda_repo_url?)",
        "shardstack_shared_dri (did you mean shardstack_shared_dir?)",
    ]


def test_unknown_variables_flagged_with_a_suggestion(tmp_path: Path) -> None:
    role = tmp_path / "roles" / "widget"
    (role / "defaults").mkdir(parents=True)
    (role / "meta").mkdir()
    (role / "defaults" / "main.yml").write_text("widget_size: 3\n")
    (role / "meta" / "argument_specs.yml").write_text(
        "argument_specs:\n  main:\n    options:\n      widget_color: {type: str, default: red}\n"
    )
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "all.yml").write_text("shardstack_cluster_name: demo\nother: 1\n")
    catalog = inv.known_variables(str(tmp_path))
    assert catalog["prefixes"] == ["shardstack_", "widget_"]
    names = [
        "widget_size",
        "widget_color",
        "widget_sise",
        "widget_flavour",
        "shardstack_cluster_name",
        "shardstack_clustr_name",
        "ansible_host",
        "unrelated_var",
    ]
    assert inv.unknown_variables(names, catalog) == [
        "shardstack_clustr_name (did you mean shardstack_cluster_name?)",
        "widget_flavour",
        "widget_sise (did you mean widget_size?)",
    ]
